#include "train/token_sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace forge {

void validate_sampling(const SamplingOptions& o) {
  if (!std::isfinite(o.temperature) || o.temperature < 0.0)
    FORGE_FAIL("--temperature {}: expected a finite number >= 0 (0: greedy)", o.temperature);
  if (o.top_k < 0) FORGE_FAIL("--top-k {}: expected an integer >= 0 (0: no limit)", o.top_k);
  if (!(o.top_p > 0.0 && o.top_p <= 1.0)) FORGE_FAIL("--top-p {}: expected a number in (0, 1]", o.top_p);
  if (o.temperature == 0.0 && (o.top_k > 0 || o.top_p < 1.0))
    FORGE_FAIL("--top-k and --top-p choose among sampled tokens: give --temperature > 0 with them (temperature 0 is "
               "greedy decoding)");
}

TokenSampler::TokenSampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {
  validate_sampling(options);
}

int32_t TokenSampler::next(std::span<const float> logits) {
  FORGE_CHECK(!logits.empty(), "sampling from no logits");
  for (size_t i = 0; i < logits.size(); ++i)
    if (std::isnan(logits[i])) FORGE_FAIL("the model's logit of token {} is NaN: the weights are broken", i);
  if (options_.temperature == 0.0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const auto n = static_cast<int32_t>(logits.size());
  order_.resize(static_cast<size_t>(n));
  std::iota(order_.begin(), order_.end(), 0);
  std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  size_t keep = order_.size();
  if (options_.top_k > 0) keep = std::min(keep, static_cast<size_t>(options_.top_k));
  // Softmax of logits / T over the kept tokens, largest first (exponents <= 0).
  const double top = logits[order_[0]] / options_.temperature;
  weights_.resize(keep);
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) sum += weights_[i] = std::exp(logits[order_[i]] / options_.temperature - top);
  if (options_.top_p < 1.0) {
    double cumulative = 0.0;
    size_t nucleus = 0;
    while (nucleus < keep) {
      cumulative += weights_[nucleus++] / sum;
      if (cumulative >= options_.top_p) break;
    }
    keep = nucleus;
    sum = std::accumulate(weights_.begin(), weights_.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  }
  double u = rng_.uniform() * sum;
  for (size_t i = 0; i < keep; ++i) {
    u -= weights_[i];
    if (u < 0.0) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace forge
