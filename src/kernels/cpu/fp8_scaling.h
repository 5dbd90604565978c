// FP8 scaling recipes on the host: amax, scales, quantization, dequantization and the
// scaled FP8 matmul, the CPU reference of the GPU kernels and of forge's FP8 training.
//
// NOTE [FP8 scaling recipes]
// A tensor is quantized as q = cast_saturated(x * scale) (fp32 product, NOTE [FP8 formats]
// in fp8.h) and read back as q / scale; a GEMM multiplies the codes and applies the two
// inverse scales (1 / scale, fp32, what cuBLASLt's A/B_SCALE_POINTER take). Each scale
// covers one block of a row-major [rows, cols] operand, cols being the contracted K:
//   tensorwise  one block: the whole tensor (torchao "tensorwise", TE Float8CurrentScaling,
//               and TE DelayedScaling with a scale from the amax history);
//   rowwise     1 x cols: one scale per row (torchao "rowwise", axiswise along K);
//   1x128       1 x 128 tiles along K (TE Float8BlockScaling / DeepSeek-V3 activations and
//               gradients), 128x128 blocks (their weights); edge blocks are partial.
// Scales from an amax, as each anchor computes them:
//  - torchao amax_to_scale (torchao 0.18 float8/float8_utils.py): in float64,
//    fp8_max / max(amax, 1e-12), rounded to fp32; with round_scales_to_power_of_2 (on for
//    "rowwise", off for "tensorwise") exp2(floor(log2(scale))) in fp32. log2 rounds to
//    fp32 first, so a scale within a few ulp below 2^k becomes 2^k (slightly above it);
//    forge reproduces that. NaN amax gives a NaN scale, inf amax a zero scale: torchao
//    does not guard these, forge's trainer will refuse a non-finite amax before using it.
//  - TE compute_scale_from_amax (transformer_engine/common/recipe/recipe_common.cuh,
//    current and block scaling): amax < epsilon is raised to epsilon; amax 0, inf or NaN
//    gives scale 1; otherwise fp8_max / amax in fp32, an infinite result replaced by
//    value_for_inf (the input type's largest finite), and with power-of-2 scales the
//    mantissa bits cleared (round down). Float8BlockScaling uses epsilon 0, power of 2.
//  - TE DelayedScaling (transformer_engine/common/recipe/delayed_scaling.cu,
//    amax_and_scale_update): history[0] holds the newest amax; the scale's amax is the
//    maximum of the whole history ("max") or history[0] ("most_recent"); scale =
//    (fp8_max * 2^-margin) / amax when that amax is finite and positive, else the previous
//    scale; then the history rolls: history[i] = history[i + 1], the last slot takes the
//    old history[0], and history[0] is zeroed for the next step's amax.
#pragma once

#include <cstdint>

#include "kernels/cpu/fp8.h"

namespace forge::cpu {

// The shape of the block one scale covers; a whole tensor is {rows, cols}.
struct Fp8Blocks {
  int64_t rows = 1;
  int64_t cols = 1;
};

inline constexpr float kTorchaoAmaxEpsilon = 1e-12f;

// Number of scales of a [rows, cols] tensor, row-major over the block grid.
int64_t fp8_scale_count(int64_t rows, int64_t cols, Fp8Blocks blocks);

// max |x| of each block (NaN if the block holds a NaN).
void fp8_block_amax(const float* x, int64_t rows, int64_t cols, Fp8Blocks blocks, float* amax);

float fp8_scale_torchao(float amax, Fp8Format format, bool round_to_power_of_2);
float fp8_scale_transformer_engine(float amax, Fp8Format format, bool power_of_2, float epsilon,
                                   float value_for_inf);

enum class Fp8AmaxAlgorithm : uint8_t { Max, MostRecent };
// Updates history[length] in place and returns the new scale (TE amax_and_scale_update).
float fp8_delayed_scale_update(float* history, int64_t length, float previous_scale, Fp8AmaxAlgorithm algorithm,
                               float margin, Fp8Format format);

// NOTE [FP8 projection statistics]
// Each projection trained in FP8 keeps one fp32 block of kFp8ProjectionStats floats on the
// run's device: for each of the three tensors it quantizes (its role: the input x, the
// weight W, the output gradient dy) `seen`, the largest |t| met since the last optimizer
// step (every quantization folds its amax in, NaN winning), and the delayed recipe's
// `scale` and `scale_inv`. Each value sits on its own kFp8StatStride boundary (256 bytes:
// cuBLASLt reads scale_inv through a pointer and the H100 refused pointers 4-20 bytes past
// a 256-byte boundary, ops/fp8_linear.h). A model's blocks are one array, so a step's end
// is a pass over it (the functions below and their CUDA twins in kernels/cuda/fp8_delayed.h):
// find the first non-finite seen amax (which the trainer names), then, for delayed
// scaling, put each seen amax into history[0] of its role and run TE's update
// (fp8_delayed_scale_update: x and W in E4M3, dy in the gradient format), and zero every
// seen. The histories are [projection][role][length] fp32.
enum class Fp8Role : uint8_t { X = 0, W = 1, Dy = 2 };
inline constexpr int kFp8Roles = 3;
inline constexpr int64_t kFp8StatStride = 64;  // floats: 256 bytes
inline constexpr int64_t kFp8ProjectionStats = 3 * kFp8Roles * kFp8StatStride;
constexpr int64_t fp8_seen_offset(int64_t projection, Fp8Role role) {
  return projection * kFp8ProjectionStats + 3 * static_cast<int64_t>(role) * kFp8StatStride;
}
constexpr int64_t fp8_scale_offset(int64_t projection, Fp8Role role) {
  return fp8_seen_offset(projection, role) + kFp8StatStride;
}
constexpr int64_t fp8_scale_inv_offset(int64_t projection, Fp8Role role) {
  return fp8_seen_offset(projection, role) + 2 * kFp8StatStride;
}
const char* fp8_role_name(Fp8Role role);  // "input x", "weight W", "output gradient dy"

// precision.fp8 delayed's settings (TE DelayedScaling's amax_history_len, amax_compute_algo,
// margin) and the gradients' format.
struct Fp8DelayedRecipe {
  int64_t history_length = 1024;
  Fp8AmaxAlgorithm algorithm = Fp8AmaxAlgorithm::Max;
  float margin = 0.0f;
  Fp8Format grad_format = Fp8Format::E5M2;
};
Fp8Format fp8_role_format(Fp8Role role, Fp8Format grad_format);

// Fresh blocks: seen 0, scale and scale_inv 1 (TE's initial scale).
void fp8_init_stats(float* stats, int64_t projections);
// projection * kFp8Roles + role of the first non-finite seen amax, or -1.
int64_t fp8_first_nonfinite_seen(const float* stats, int64_t projections);
// The delayed update of every projection and role (history [projections][kFp8Roles][length]),
// then seen zeroed.
void fp8_delayed_step(float* stats, float* history, int64_t projections, const Fp8DelayedRecipe& recipe);
void fp8_clear_seen(float* stats, int64_t projections);

// q = cast_saturated(x * scale of its block).
void fp8_quantize(const float* x, int64_t rows, int64_t cols, Fp8Blocks blocks, const float* scales,
                  Fp8Format format, uint8_t* q);
// x = fp8_to_float(q) / scale of its block.
void fp8_dequantize(const uint8_t* q, int64_t rows, int64_t cols, Fp8Blocks blocks, const float* scales,
                    Fp8Format format, float* x);

// One operand of a scaled FP8 GEMM: codes [rows, k] row-major and the scales of `blocks`.
struct Fp8Operand {
  const uint8_t* codes;
  Fp8Format format;
  const float* scales;
  Fp8Blocks blocks;
};

// out[m, n] = sum_k deq(a[m, k]) deq(b[n, k]), i.e. a @ b^T, as a scaled FP8 GEMM defines
// it: over each run of k where both operands' scales are constant, the exact sum of the
// decoded products (in double) times (1 / a_scale) * (1 / b_scale) (fp32 inverses); the
// runs summed in double and rounded to fp32 at the end.
void fp8_matmul_reference(const Fp8Operand& a, const Fp8Operand& b, int64_t m, int64_t n, int64_t k, float* out);

}  // namespace forge::cpu
