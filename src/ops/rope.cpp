#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/cpu/rope.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/rope.h"
#endif

namespace forge {
namespace {

// Hugging Face's "llama3" rope scaling (Llama 3.1): wavelengths longer than
// original_max_position / low_freq_factor are slowed down by `factor`, those shorter than
// original_max_position / high_freq_factor are kept, and the band between interpolates
// smoothly between the two. Comparisons follow transformers' _compute_llama3_parameters.
double llama3_scaled(double inv_freq, const RopeScaling& s) {
  double original = static_cast<double>(s.original_max_position);
  double low_freq_wavelen = original / s.low_freq_factor;
  double high_freq_wavelen = original / s.high_freq_factor;
  double wavelen = 2.0 * std::numbers::pi / inv_freq;
  if (wavelen > low_freq_wavelen) return inv_freq / s.factor;
  if (wavelen < high_freq_wavelen) return inv_freq;
  double smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq;
}

// mscale(s, m) of NOTE in ops/rope.h (transformers' get_mscale).
double yarn_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// YaRN's frequencies (NOTE at RopeScaling in ops/rope.h), in double where transformers
// computes in fp32.
std::vector<double> yarn_inv_freq(int64_t head_dim, double theta, const RopeScaling& s) {
  const double dim = static_cast<double>(head_dim);
  auto [low, high] = yarn_ramp(head_dim, theta, s);
  if (low == high) high += 0.001;  // as transformers, against a zero-width ramp
  std::vector<double> inv_freq(static_cast<size_t>(head_dim / 2));
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const double extrapolated = 1.0 / std::pow(theta, static_cast<double>(2 * i) / dim);
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double keep = 1.0 - ramp;  // the share of the extrapolated (unscaled) frequency
    inv_freq[static_cast<size_t>(i)] = extrapolated / s.factor * (1.0 - keep) + extrapolated * keep;
  }
  return inv_freq;
}

void check_rope_args(const Tensor& x, int64_t num_rotated_heads, const Tensor& cos, const Tensor& sin,
                     const Tensor* positions, const char* op) {
  FORGE_CHECK(x.ndim() == 4, "{}: x {} must be [B, T, heads, D]", op, shape_str(x.shape()));
  FORGE_CHECK(x.dim(3) % 2 == 0, "{}: head_dim {} must be even", op, x.dim(3));
  FORGE_CHECK(0 <= num_rotated_heads && num_rotated_heads <= x.dim(2), "{}: {} rotated heads of {}", op,
              num_rotated_heads, x.dim(2));
  FORGE_CHECK(cos.ndim() == 2 && cos.dim(0) >= x.dim(1) && cos.dim(1) == x.dim(3) / 2,
              "{}: cos table {} does not cover seq {} and head_dim {}", op, shape_str(cos.shape()), x.dim(1),
              x.dim(3));
  check_shape(sin, cos.shape(), op);
  expect_tensor(x, x.device(), x.device() == Device::CUDA ? DType::BF16 : DType::F32, op);
  expect_tensor(cos, x.device(), DType::F32, op);
  expect_tensor(sin, x.device(), DType::F32, op);
  if (!positions) return;
  check_shape(*positions, {x.dim(0), x.dim(1)}, op);
  expect_tensor(*positions, x.device(), DType::I32, op);
  if (positions->device() != Device::CPU) return;
  const int32_t* p = positions->data<int32_t>();
  for (int64_t i = 0; i < positions->numel(); ++i)
    FORGE_CHECK(p[i] >= 0 && p[i] < cos.dim(0), "{}: position {} of token {} is outside the table's {} rows", op,
                p[i], i, cos.dim(0));
}

void rope_apply(const Tensor& x, int64_t num_rotated_heads, const Tensor& cos, const Tensor& sin,
                const Tensor* positions, bool inverse, const char* op) {
  check_rope_args(x, num_rotated_heads, cos, sin, positions, op);
  const int32_t* position_data = positions ? positions->data<int32_t>() : nullptr;
  if (x.device() == Device::CUDA) {
    FORGE_CUDA_CALL(op, cuda::rope_rotate(static_cast<cuda::bf16*>(x.raw()), x.dim(0), x.dim(1), x.dim(2), x.dim(3),
                                          num_rotated_heads, cos.data<float>(), sin.data<float>(), position_data,
                                          inverse));
    return;
  }
  cpu::rope_rotate(x.data<float>(), x.dim(0), x.dim(1), x.dim(2), x.dim(3), num_rotated_heads, cos.data<float>(),
                   sin.data<float>(), position_data, inverse);
}

}  // namespace

YarnRamp yarn_ramp(int64_t head_dim, double theta, const RopeScaling& s, bool rounded) {
  const double dim = static_cast<double>(head_dim), original = static_cast<double>(s.original_max_position);
  // The dimension whose wavelength turns `rotations` times within the original context.
  auto correction_dim = [&](double rotations) {
    return dim * std::log(original / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
  };
  const double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  return {std::max(rounded ? std::floor(low) : low, 0.0), std::min(rounded ? std::ceil(high) : high, dim - 1.0)};
}

std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling) {
  FORGE_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope_inv_freq: head_dim {} must be even", head_dim);
  FORGE_CHECK(theta > 0.0, "rope_inv_freq: theta {} must be positive", theta);
  if (scaling.yarn()) {
    FORGE_CHECK(scaling.factor >= 1.0 && scaling.original_max_position > 0 && scaling.beta_fast > 0.0 &&
                    scaling.beta_slow > 0.0,
                "rope_inv_freq: bad yarn scaling (factor {}, original {}, beta_fast {}, beta_slow {})", scaling.factor,
                scaling.original_max_position, scaling.beta_fast, scaling.beta_slow);
    return yarn_inv_freq(head_dim, theta, scaling);
  }
  if (scaling.enabled) {
    FORGE_CHECK(scaling.type == "llama3", "rope_inv_freq: unknown rope scaling type '{}'", scaling.type);
    FORGE_CHECK(scaling.factor > 0.0 && scaling.low_freq_factor > 0.0 &&
                    scaling.high_freq_factor > scaling.low_freq_factor && scaling.original_max_position > 0,
                "rope_inv_freq: bad llama3 scaling (factor {}, low {}, high {}, original {})", scaling.factor,
                scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position);
  }
  std::vector<double> inv_freq(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    inv_freq[i] = scaling.enabled ? llama3_scaled(f, scaling) : f;
  }
  return inv_freq;
}

double rope_attention_factor(const RopeScaling& s) {
  if (!s.yarn()) return 1.0;
  if (s.mscale != 0.0 && s.mscale_all_dim != 0.0) return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  return yarn_mscale(s.factor, 1.0);
}

double rope_softmax_scale(const RopeScaling& s) {
  if (!s.yarn() || s.mscale_all_dim == 0.0) return 1.0;
  const double m = yarn_mscale(s.factor, s.mscale_all_dim);
  return m * m;
}

void rope_tables(Tensor& cos, Tensor& sin, const std::vector<double>& inv_freq, int64_t max_positions,
                 double scale) {
  int64_t half = static_cast<int64_t>(inv_freq.size());
  cos = Tensor::empty({max_positions, half});
  sin = Tensor::empty({max_positions, half});
  float* c = cos.data<float>();
  float* s = sin.data<float>();
  for (int64_t t = 0; t < max_positions; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      double angle = static_cast<double>(t) * inv_freq[i];
      c[t * half + i] = static_cast<float>(scale * std::cos(angle));
      s[t * half + i] = static_cast<float>(scale * std::sin(angle));
    }
  }
}

void rope_forward(const Tensor& x, int64_t num_rotated_heads, const Tensor& cos, const Tensor& sin,
                  const Tensor* positions) {
  OpProfileScope profile(OpClass::Elementwise, "rope_forward");
  rope_apply(x, num_rotated_heads, cos, sin, positions, false, "rope_forward");
}

void rope_backward(const Tensor& dx, int64_t num_rotated_heads, const Tensor& cos, const Tensor& sin,
                   const Tensor* positions) {
  OpProfileScope profile(OpClass::Elementwise, "rope_backward");
  rope_apply(dx, num_rotated_heads, cos, sin, positions, true, "rope_backward");
}

}  // namespace forge
