// FP8 amax, scales, quantization and the reference FP8 matmul (NOTE [FP8 scaling recipes]
// in fp8_scaling.h).
#include "kernels/cpu/fp8_scaling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

int64_t blocks_across(int64_t cols, Fp8Blocks blocks) { return (cols + blocks.cols - 1) / blocks.cols; }

int64_t scale_index(int64_t r, int64_t c, int64_t cols, Fp8Blocks blocks) {
  return (r / blocks.rows) * blocks_across(cols, blocks) + c / blocks.cols;
}

}  // namespace

int64_t fp8_scale_count(int64_t rows, int64_t cols, Fp8Blocks blocks) {
  return ((rows + blocks.rows - 1) / blocks.rows) * blocks_across(cols, blocks);
}

void fp8_block_amax(const float* x, int64_t rows, int64_t cols, Fp8Blocks blocks, float* amax) {
  std::fill(amax, amax + fp8_scale_count(rows, cols, blocks), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& m = amax[scale_index(r, c, cols, blocks)];
      const float a = std::fabs(x[r * cols + c]);
      if (std::isnan(a) || a > m) m = std::isnan(m) ? m : a;
    }
}

float fp8_scale_torchao(float amax, Fp8Format format, bool round_to_power_of_2) {
  const double clamped = std::isnan(amax) ? static_cast<double>(amax)
                                          : std::max(static_cast<double>(amax), static_cast<double>(kTorchaoAmaxEpsilon));
  float scale = static_cast<float>(static_cast<double>(fp8_max(format)) / clamped);
  if (round_to_power_of_2) {
    const float log2_scale = static_cast<float>(std::log2(static_cast<double>(scale)));  // torch.log2 in fp32
    scale = std::exp2(std::floor(log2_scale));
  }
  return scale;
}

float fp8_scale_transformer_engine(float amax, Fp8Format format, bool power_of_2, float epsilon,
                                   float value_for_inf) {
  if (amax < epsilon) amax = epsilon;
  if (std::isinf(amax) || amax == 0.0f || std::isnan(amax)) return 1.0f;
  float scale = fp8_max(format) / amax;
  if (std::isinf(scale)) scale = value_for_inf;
  if (power_of_2) {
    uint32_t bits;
    std::memcpy(&bits, &scale, 4);
    bits &= 0xff800000u;
    std::memcpy(&scale, &bits, 4);
  }
  return scale;
}

float fp8_delayed_scale_update(float* history, int64_t length, float previous_scale, Fp8AmaxAlgorithm algorithm,
                               float margin, Fp8Format format) {
  const float newest = history[0];
  float amax = 0.0f;
  for (int64_t i = 0; i < length; ++i) amax = std::fmax(amax, history[i]);  // fmaxf, as the TE kernel: NaN ignored
  if (algorithm == Fp8AmaxAlgorithm::MostRecent) amax = newest;
  for (int64_t i = 1; i + 1 < length; ++i) history[i] = history[i + 1];
  if (length > 1) history[length - 1] = newest;
  history[0] = 0.0f;
  const float scaled_max = fp8_max(format) * std::pow(2.0f, -margin);
  return std::isfinite(amax) && amax > 0.0f ? scaled_max / amax : previous_scale;
}

void fp8_quantize(const float* x, int64_t rows, int64_t cols, Fp8Blocks blocks, const float* scales,
                  Fp8Format format, uint8_t* q) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      q[r * cols + c] = fp8_from_float_saturated(x[r * cols + c] * scales[scale_index(r, c, cols, blocks)], format);
}

void fp8_dequantize(const uint8_t* q, int64_t rows, int64_t cols, Fp8Blocks blocks, const float* scales,
                    Fp8Format format, float* x) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      x[r * cols + c] = fp8_to_float(q[r * cols + c], format) / scales[scale_index(r, c, cols, blocks)];
}

void fp8_matmul_reference(const Fp8Operand& a, const Fp8Operand& b, int64_t m, int64_t n, int64_t k, float* out) {
  std::vector<float> decoded_a(static_cast<size_t>(m * k)), decoded_b(static_cast<size_t>(n * k));
  fp8_to_float(a.codes, m * k, a.format, decoded_a.data());
  fp8_to_float(b.codes, n * k, b.format, decoded_b.data());
  // Rows in parallel: each output element is one thread's, summed in the same order.
  parallel_for(m, 1, [&](int64_t row_begin, int64_t row_end) {
    for (int64_t i = row_begin; i < row_end; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double total = 0.0, run = 0.0;
        int64_t run_a = scale_index(i, 0, k, a.blocks), run_b = scale_index(j, 0, k, b.blocks);
        for (int64_t c = 0; c < k; ++c) {
          const int64_t sa = scale_index(i, c, k, a.blocks), sb = scale_index(j, c, k, b.blocks);
          if (sa != run_a || sb != run_b) {
            total += run * (1.0f / a.scales[run_a]) * (1.0f / b.scales[run_b]);
            run = 0.0;
            run_a = sa;
            run_b = sb;
          }
          run += static_cast<double>(decoded_a[i * k + c]) * decoded_b[j * k + c];
        }
        total += run * (1.0f / a.scales[run_a]) * (1.0f / b.scales[run_b]);
        out[i * n + j] = static_cast<float>(total);
      }
  });
}

const char* fp8_role_name(Fp8Role role) {
  switch (role) {
    case Fp8Role::X: return "input x";
    case Fp8Role::W: return "weight W";
    case Fp8Role::Dy: return "output gradient dy";
  }
  return "?";
}

Fp8Format fp8_role_format(Fp8Role role, Fp8Format grad_format) {
  return role == Fp8Role::Dy ? grad_format : Fp8Format::E4M3;
}

void fp8_init_stats(float* stats, int64_t projections) {
  for (int64_t p = 0; p < projections; ++p)
    for (int r = 0; r < kFp8Roles; ++r) {
      const auto role = static_cast<Fp8Role>(r);
      stats[fp8_seen_offset(p, role)] = 0.0f;
      stats[fp8_scale_offset(p, role)] = 1.0f;
      stats[fp8_scale_inv_offset(p, role)] = 1.0f;
    }
}

int64_t fp8_first_nonfinite_seen(const float* stats, int64_t projections) {
  for (int64_t p = 0; p < projections; ++p)
    for (int r = 0; r < kFp8Roles; ++r)
      if (!std::isfinite(stats[fp8_seen_offset(p, static_cast<Fp8Role>(r))])) return p * kFp8Roles + r;
  return -1;
}

void fp8_delayed_step(float* stats, float* history, int64_t projections, const Fp8DelayedRecipe& recipe) {
  for (int64_t p = 0; p < projections; ++p)
    for (int r = 0; r < kFp8Roles; ++r) {
      const auto role = static_cast<Fp8Role>(r);
      float* h = history + (p * kFp8Roles + r) * recipe.history_length;
      h[0] = stats[fp8_seen_offset(p, role)];
      const float scale = fp8_delayed_scale_update(h, recipe.history_length, stats[fp8_scale_offset(p, role)],
                                                   recipe.algorithm, recipe.margin,
                                                   fp8_role_format(role, recipe.grad_format));
      stats[fp8_scale_offset(p, role)] = scale;
      stats[fp8_scale_inv_offset(p, role)] = 1.0f / scale;
    }
  fp8_clear_seen(stats, projections);
}

void fp8_clear_seen(float* stats, int64_t projections) {
  for (int64_t p = 0; p < projections; ++p)
    for (int r = 0; r < kFp8Roles; ++r) stats[fp8_seen_offset(p, static_cast<Fp8Role>(r))] = 0.0f;
}

}  // namespace forge::cpu
