// NOTE [Flow timesteps]
// Rectified-flow training (ops/flow_matching.h) draws each sample's time t in (0, 1) in two
// steps: a density over t (SD3's logit-normal sampling), then the shift towards noise that
// FLUX's sampling schedule applies (BFL's flux code, diffusers' FluxPipeline and schedulers):
//   1. t0 from the weighting: "logit_normal": t0 = sigmoid(logit_mean + logit_std z), z
//      standard normal (SD3's logit-normal sampling, diffusers'
//      compute_density_for_timestep_sampling); "uniform": t0 = u, u uniform in (0, 1).
//   2. the shift, which moves t towards the noisy end for larger images:
//      "resolution": mu = base_shift + (max_shift - base_shift) (seq_len - base_seq_len) /
//        (max_seq_len - base_seq_len) over the image's seq_len tokens (BFL's get_lin_function,
//        diffusers' calculate_shift), t = e^mu / (e^mu + (1/t0 - 1)) (BFL's time_shift with
//        sigma 1, diffusers' FlowMatchEulerDiscreteScheduler exponential time shift);
//      "fixed": t = s t0 / (1 + (s - 1) t0), s = shift_value (SD3; diffusers' scheduler
//        `shift`); the resolution form is this one with s = e^mu;
//      "none": t = t0.
// The draws of a step come from the counter-based generator of kernels/philox.h, counter
// (sample, micro-batch, step mod 2^32, step / 2^32) under the key `seed` (see
// sample_flow_timesteps): a function of where they are used, never of what ran before, so
// a resumed run draws exactly what the uninterrupted one would have. The settings are
// flux.* (NOTE [FLUX runs]) (the names below); validate() names the key a bad value came from.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config_check.h"

namespace forge {
namespace flow_bounds {

inline const std::vector<std::string> weightings = {"logit_normal", "uniform"};
inline const std::vector<std::string> shifts = {"resolution", "fixed", "none"};
inline constexpr ValueRange logit_std = above(0);
inline constexpr ValueRange shift_value = above(0);
inline constexpr ValueRange base_seq_len = at_least(1);

}  // namespace flow_bounds

struct FlowTimestepSampling {
  std::string weighting = "logit_normal";  // logit_normal | uniform
  double logit_mean = 0.0;
  double logit_std = 1.0;
  std::string shift = "resolution";  // resolution | fixed | none
  double shift_value = 3.0;          // s of the fixed shift
  double base_shift = 0.5;           // mu at base_seq_len tokens (resolution shift)
  double max_shift = 1.15;           // mu at max_seq_len tokens
  int64_t base_seq_len = 256;
  int64_t max_seq_len = 4096;

  // Fails naming the first bad key ("flux.logit_std must be > 0, got 0"); `keys`
  // adds where its value came from (NOTE [Config rules name their keys through the caller]).
  void validate(const KeyDescriber& keys = {}) const;
};

// The shift's mu for an image of seq_len tokens (the resolution shift's line).
double flow_shift_mu(const FlowTimestepSampling& s, int64_t seq_len);

// t for one draw: `draw` is z (standard normal) under logit_normal, u in (0, 1) under
// uniform; seq_len is the image's token count (read only by the resolution shift).
double flow_timestep(const FlowTimestepSampling& s, double draw, int64_t seq_len);

// The times of one micro-batch of `batch` samples of seq_len tokens: t[j] is flow_timestep
// of draw j of (step, micro_batch) in the stream `seed`, which should be the run's seed
// derived for this purpose alone (derive_seed), apart from the noise's. Philox gives
// (x0, x1, x2, x3) for counter (j, micro_batch, step mod 2^32, step / 2^32); the draw is
// z = Box-Muller(x0, x1)'s first number under logit_normal (kernels/philox.h), u =
// (floor(x0 / 2^8) + 1/2) 2^-24 under uniform.
std::vector<float> sample_flow_timesteps(const FlowTimestepSampling& s, uint64_t seed, int64_t step,
                                         int64_t micro_batch, int64_t batch, int64_t seq_len);

}  // namespace forge
