// Which components a decoder block is made of, chosen from ModelConfig: the one place a
// new attention or feed-forward kind is added (NOTE [Composed blocks]).
#pragma once

#include <memory>
#include <vector>

#include "model/block_component.h"
#include "model/config.h"
#include "model/pipeline_stage.h"

namespace forge {

// The components of every block, in the order a block applies them.
using BlockComponents = std::vector<std::unique_ptr<BlockComponent>>;

// Llama family: self-attention (GQA/MHA, optional sliding window), then a SwiGLU
// feed-forward; a Mixture-of-Experts model's feed-forward is MoeFeedForward, after
// model.first_dense_layers dense blocks (SplitByLayer). `stage`: the blocks a pipeline stage
// computes (NOTE [Pipeline stages]), whose components number them from 0: a stage of dense
// blocks alone or of MoE blocks alone takes that feed-forward alone, one that holds the
// boundary a SplitByLayer told its first block.
BlockComponents make_block_components(const ModelConfig& config, const PipelineStage& stage = {});

}  // namespace forge
