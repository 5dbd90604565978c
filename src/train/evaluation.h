// forge eval's measurement: the mean cross-entropy (nats per target token) and perplexity
// of given weights on `batches` micro-batches of an experiment's data, read as forge train
// reads its validation data (the same dataset seed; a fresh loader from the split's
// start), on the experiment's device with DecoderLM::forward_loss. Masked targets (loss
// masks, padding) are not counted (NOTE [Loss normalization]).
#pragma once

#include <cstdint>

#include "data/dataset.h"
#include "model/parameters.h"
#include "train/experiment.h"

namespace forge {

struct EvalSummary {
  double loss = 0.0;        // nats per target token
  double perplexity = 0.0;  // exp(loss)
  int64_t tokens = 0;       // targets counted
  int64_t batches = 0, sequences = 0;
  int64_t samples_in_split = 0;  // sequences one epoch of the split holds
  double seconds = 0.0;
};

// `weights` are fp32 in host memory with config.model's layout; on CUDA they are copied to
// the GPU in bf16 first.
EvalSummary evaluate_weights(const ExperimentConfig& config, FlatParameters& weights, Split split, int64_t batches);

}  // namespace forge
