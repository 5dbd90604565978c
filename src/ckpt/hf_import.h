// Importing a Hugging Face Llama / Mistral / Mixtral model directory into forge.
//
// config.json gives the architecture (hf_config.h); the safetensors files give the
// weights (hf_weight_files.h), looked up by each parameter's Hugging Face names and, for
// forge's fused qkv and gate_up tensors and a MoE block's stacked experts, stacked along
// dim 0 (NOTE [Fused projections] in model/parameters.h; Mixtral's per-expert names, or
// transformers 5's whole stacks: NOTE [MoE Hugging Face names] in model/moe_feed_forward.h).
// Weights stored as F32, BF16, F16 or F64 are converted to fp32.
// Every expected tensor must be present with exactly the shape the config implies; a
// tensor forge would not use is an error too (it means the file describes another
// model), except the rotary inv_freq buffers some exporters save, which are recomputed.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/hf_config.h"
#include "model/config.h"
#include "model/parameters.h"

namespace forge {

struct HfModel {
  ModelConfig config;
  std::unique_ptr<FlatParameters> params;
};

// The model of a Hugging Face directory: its config.json mapped to ModelConfig (named
// after the directory) and its weights.
HfModel load_hf_model(const std::string& dir);

// How DIR's weights are stored (NOTE [DeepSeek config keys] in hf_config.h); the defaults
// without a config.json.
HfWeightLayout read_weight_layout(const std::string& dir);

// Loads the weights of DIR into params (fp32, host memory), whose layout
// (params.config()) must be the one DIR/config.json describes.
void load_hf_weights(const std::string& dir, FlatParameters& params);

// The architecture fields in which `configured` and `hf` (from config.json) differ, each
// as "model.<key>: <configured> here, <hf> in config.json"; empty when they match. The
// name and init_std are not architecture.
std::vector<std::string> architecture_differences(const ModelConfig& configured, const ModelConfig& hf);

// The --model.<key> VALUE overrides that give a run the architecture of `hf`.
std::string model_overrides_for(const ModelConfig& hf);

// For training from a Hugging Face model: checks that params' architecture is the one
// DIR/config.json describes (failing with every difference and the overrides that would
// fix them), then loads the weights.
void load_hf_weights_checked(const std::string& dir, FlatParameters& params);

// The same checks and reads, one forge parameter at a time (parameter_specs order): each
// is handed to `consume` as fp32 host values in a buffer reused for the next, so only the
// largest parameter is ever held (QLoRA's import, NOTE [QLoRA base] in model/nf4_base.h).
// With `shard` each is tensor-parallel rank shard.rank's shard of it (NOTE [Tensor-parallel
// shards] in model/parameters.h, shaped as parameter_specs(config, shard) says), and only
// the shard's elements are read from the files. With `stages` (a pipeline rank's: NOTE
// [Pipeline stages] in model/pipeline_stage.h) only the stages' parameters are read and
// handed over (pipeline_stage_specs); the others' tensors are checked all the same, so every
// rank refuses a damaged model alike.
void for_each_hf_parameter(const std::string& dir, const ModelConfig& config,
                           const std::function<void(size_t, const Tensor&)>& consume, TensorParallelShard shard = {},
                           const std::vector<PipelineStage>& stages = {});

}  // namespace forge
