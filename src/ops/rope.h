// Rotary position embeddings in the "rotate half" convention of Hugging Face Llama:
// for each head vector x of size D and position t, pairs (x[i], x[i + D/2]) are rotated
// by angle t * inv_freq[i]. Applied in place to the first `num_rotated_heads` heads of a
// packed [B, T, heads, D] tensor (the q and k heads of the fused QKV projection output).
// The backward is the inverse rotation, applied in place to the gradient.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace forge {

// Frequency scaling for context extension, as Hugging Face's rope_type names it:
//   "llama3"  Llama 3.1's: wavelengths beyond original_max_position / low_freq_factor are
//             slowed down by `factor`, those below original / high_freq_factor kept, the
//             band between interpolated (transformers' _compute_llama3_parameters);
//   "yarn"    YaRN (DeepSeek-V2/V3): each frequency blends its extrapolated value theta^(-2i/D)
//             and its interpolated value / factor by a linear ramp over the dimensions
//             whose wavelength completes between beta_fast and beta_slow rotations within
//             original_max_position (bounds floored and ceiled), and cos/sin are multiplied by
//             the attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)
//             with mscale(s, m) = 0.1 m ln s + 1 (when both are set, else mscale(factor, 1))
//             (transformers' _compute_yarn_parameters). DeepSeek's attention also multiplies
//             its softmax scale by mscale(factor, mscale_all_dim)^2 (rope_softmax_scale).
struct RopeScaling {
  bool enabled = false;
  double factor = 8.0;
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  int64_t original_max_position = 8192;
  std::string type = "llama3";    // "llama3" or "yarn"
  double beta_fast = 32.0;        // yarn
  double beta_slow = 1.0;         // yarn
  double mscale = 0.0;            // yarn; 0: not set
  double mscale_all_dim = 0.0;    // yarn; 0: not set
  bool yarn() const { return enabled && type == "yarn"; }
};

// YaRN's ramp: the dimensions (of head_dim) from `low`, where interpolation starts, to `high`,
// where it is complete, i.e. where the wavelength turns beta_fast and beta_slow times within
// original_max_position; `rounded` floors low and ceils high, as forge and transformers'
// default (its rope parameter "truncate": true) do; both are then clamped to [0, head_dim - 1].
struct YarnRamp {
  double low = 0.0, high = 0.0;
  bool operator==(const YarnRamp&) const = default;
};
YarnRamp yarn_ramp(int64_t head_dim, double theta, const RopeScaling& scaling, bool rounded = true);

// inv_freq[i] = theta^(-2i/D), i < D/2, then the scaling if enabled.
std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling);
// What cos/sin are multiplied by: YaRN's attention factor; 1 otherwise.
double rope_attention_factor(const RopeScaling& scaling);
// What an attention's softmax scale is multiplied by under this scaling: DeepSeek's
// mscale(factor, mscale_all_dim)^2 for YaRN with mscale_all_dim set; 1 otherwise.
double rope_softmax_scale(const RopeScaling& scaling);

// cos/sin tables [max_positions, D/2] (fp32, CPU) for the given frequencies, times `scale`
// (rope_attention_factor).
void rope_tables(Tensor& cos, Tensor& sin, const std::vector<double>& inv_freq, int64_t max_positions,
                 double scale = 1.0);

// positions: int32 [B, T] on x's device, each token's position (packed examples restart at
// 0, NOTE [Packed examples] in ops/attention.h); null: position t for token t of every row.
// Positions must index rows of the tables (checked on the CPU; on CUDA the caller's duty).
void rope_forward(const Tensor& x, int64_t num_rotated_heads, const Tensor& cos, const Tensor& sin,
                  const Tensor* positions = nullptr);
void rope_backward(const Tensor& dx, int64_t num_rotated_heads, const Tensor& cos, const Tensor& sin,
                   const Tensor* positions = nullptr);

}  // namespace forge
