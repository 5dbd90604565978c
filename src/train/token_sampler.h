// Choosing the next token from a row of logits: greedy, or sampled as transformers'
// generate(do_sample=True) samples.
//
// Greedy (temperature 0) takes the largest logit, the first one on a tie (torch.argmax).
// Sampling applies, in transformers' order, the temperature (logits / T), top-k (keep the
// k largest), top-p (keep the smallest set of the most likely tokens whose probability,
// renormalized over what top-k kept, reaches p; always at least one), then draws from the
// softmax of what is left with a seeded generator (core/rng.h): the same seed and logits
// give the same tokens on every run and machine (not torch's draws, which no one can match).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/rng.h"

namespace forge {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  double top_p = 1.0;        // 1: no limit
  uint64_t seed = 0;
};

// Fails naming the command-line option and the value expected: temperature finite and
// >= 0, top_k >= 0, 0 < top_p <= 1, and top-k / top-p only when sampling (temperature > 0).
void validate_sampling(const SamplingOptions& options);

class TokenSampler {
 public:
  explicit TokenSampler(const SamplingOptions& options);
  int32_t next(std::span<const float> logits);

 private:
  SamplingOptions options_;
  Rng rng_;
  std::vector<int32_t> order_;
  std::vector<double> weights_;
};

}  // namespace forge
