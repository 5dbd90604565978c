// NOTE [Flow timesteps] (train/flow_timesteps.h).
#include "train/flow_timesteps.h"

#include <cmath>
#include <string_view>

#include "core/error.h"
#include "kernels/philox.h"

namespace forge {
namespace {

void check_finite(const KeyDescriber& keys, std::string_view key, double value) {
  if (!std::isfinite(value)) FORGE_FAIL("{} must be a finite number, got {}{}", key, value, keys.origin_suffix(key));
}

constexpr uint64_t kCounterWords = uint64_t{1} << 32;

}  // namespace

void FlowTimestepSampling::validate(const KeyDescriber& keys) const {
  check_choice(keys, "flux.timestep_sampling", weighting, flow_bounds::weightings);
  check_finite(keys, "flux.logit_mean", logit_mean);
  check_finite(keys, "flux.logit_std", logit_std);
  check_range(keys, "flux.logit_std", logit_std, flow_bounds::logit_std);
  check_choice(keys, "flux.timestep_shift", shift, flow_bounds::shifts);
  check_finite(keys, "flux.shift", shift_value);
  check_range(keys, "flux.shift", shift_value, flow_bounds::shift_value);
  check_finite(keys, "flux.base_shift", base_shift);
  check_finite(keys, "flux.max_shift", max_shift);
  check_range(keys, "flux.base_seq_len", base_seq_len, flow_bounds::base_seq_len);
  if (max_seq_len <= base_seq_len)
    FORGE_FAIL("{} must be above {}", keys.describe("flux.max_seq_len", max_seq_len),
               keys.describe("flux.base_seq_len", base_seq_len));
}

double flow_shift_mu(const FlowTimestepSampling& s, int64_t seq_len) {
  FORGE_CHECK(seq_len >= 1, "flow timesteps: an image of {} tokens has no resolution shift", seq_len);
  const double slope = (s.max_shift - s.base_shift) / static_cast<double>(s.max_seq_len - s.base_seq_len);
  return s.base_shift + slope * static_cast<double>(seq_len - s.base_seq_len);
}

double flow_timestep(const FlowTimestepSampling& s, double draw, int64_t seq_len) {
  double t0 = draw;
  if (s.weighting == "logit_normal") {
    t0 = 1.0 / (1.0 + std::exp(-(s.logit_mean + s.logit_std * draw)));
  } else {
    FORGE_CHECK(draw >= 0.0 && draw <= 1.0, "flow timesteps: uniform draw {} is outside [0, 1]", draw);
  }
  if (s.shift == "resolution") {
    const double e = std::exp(flow_shift_mu(s, seq_len));
    return e / (e + (1.0 / t0 - 1.0));
  }
  if (s.shift == "fixed") return s.shift_value * t0 / (1.0 + (s.shift_value - 1.0) * t0);
  return t0;
}

std::vector<float> sample_flow_timesteps(const FlowTimestepSampling& s, uint64_t seed, int64_t step,
                                         int64_t micro_batch, int64_t batch, int64_t seq_len) {
  FORGE_CHECK(step >= 0, "flow timesteps: step {} is negative", step);
  FORGE_CHECK(micro_batch >= 0 && static_cast<uint64_t>(micro_batch) < kCounterWords,
              "flow timesteps: micro-batch {} is outside [0, 2^32)", micro_batch);
  FORGE_CHECK(batch >= 0 && static_cast<uint64_t>(batch) <= kCounterWords,
              "flow timesteps: batch {} is outside [0, 2^32]", batch);
  std::vector<float> t(static_cast<size_t>(batch));
  const auto key0 = static_cast<uint32_t>(seed), key1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t j = 0; j < batch; ++j) {
    const philox::Words counter{{static_cast<uint32_t>(j), static_cast<uint32_t>(micro_batch),
                                 static_cast<uint32_t>(step), static_cast<uint32_t>(static_cast<uint64_t>(step) >> 32)}};
    const philox::Words x = philox::philox4x32_10(counter, key0, key1);
    double draw;
    if (s.weighting == "logit_normal") {
      float z0, z1;
      philox::box_muller(x.w[0], x.w[1], z0, z1);
      draw = z0;
    } else {
      draw = (static_cast<double>(x.w[0] >> 8) + 0.5) * 0x1p-24;
    }
    t[static_cast<size_t>(j)] = static_cast<float>(flow_timestep(s, draw, seq_len));
  }
  return t;
}

}  // namespace forge
