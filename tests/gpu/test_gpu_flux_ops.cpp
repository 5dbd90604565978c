// The FLUX block's normalization and elementwise ops on the GPU against the CPU reference
// on fresh random data (gpu_testing.h): modulated LayerNorm, GELU (tanh), SiLU and the
// gated residual add. Shapes include FLUX's width (3072) with an odd token count, widths of
// an odd number of 16-byte vectors (24, 136: a half-used block in the sums over tokens),
// more tokens than the sums' 128 token lanes (301), and elementwise sizes with a tail that
// is not a whole vector or a start that is not 16-byte aligned.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>

#include "gpu_testing.h"
#include "ops/gated_residual.h"
#include "ops/gelu.h"
#include "ops/modulated_layer_norm.h"
#include "ops/silu.h"

namespace forge::gpu_test {
namespace {

using Dims = std::tuple<int64_t, int64_t, int64_t>;  // batch, tokens, dim

constexpr Dims kShapes[] = {{1, 1, 8}, {3, 5, 24}, {2, 37, 3072}, {1, 301, 136}, {2, 3, 16392}};

std::string name(const Dims& s) {
  return std::to_string(std::get<0>(s)) + "x" + std::to_string(std::get<1>(s)) + "x" + std::to_string(std::get<2>(s));
}

TEST(GpuFluxNormOps, ModulatedLayerNormMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (const Dims& s : kShapes) {
    const auto [batch, tokens, dim] = s;
    const Shape full{batch, tokens, dim}, rows{batch, tokens}, modulation{batch, dim};
    Tensor x = random_bf16_values(full, rng);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += 2.0f;  // a mean the kernel must take out
    round_to_bf16(x);
    Tensor shift = random_bf16_values(modulation, rng, 0.5), scale = random_bf16_values(modulation, rng, 0.5);
    Tensor y = Tensor::empty(full), mean = Tensor::empty(rows), rstd = Tensor::empty(rows);
    modulated_layer_norm_forward(y, mean, rstd, x, shift, scale, 1e-6f);
    Tensor xg = to_gpu(x, DType::BF16), scaleg = to_gpu(scale, DType::BF16);
    Tensor yg = poisoned_gpu(full, DType::BF16), meang = poisoned_gpu(rows, DType::F32);
    Tensor rstdg = poisoned_gpu(rows, DType::F32);
    modulated_layer_norm_forward(yg, meang, rstdg, xg, to_gpu(shift, DType::BF16), scaleg, 1e-6f);
    EXPECT_LT(relative_l2(to_cpu_f32(yg), y), kBf16Tolerance) << name(s);
    EXPECT_LT(relative_l2(to_cpu_f32(meang), mean), kF32Tolerance) << name(s);
    EXPECT_LT(relative_l2(to_cpu_f32(rstdg), rstd), kF32Tolerance) << name(s);

    // dx accumulates onto dx0; dshift and dscale start poisoned and are overwritten.
    Tensor dy = random_bf16_values(full, rng), dx0 = random_bf16_values(full, rng, 0.3);
    Tensor dx = dx0.clone(), dshift = Tensor::empty(modulation), dscale = Tensor::empty(modulation);
    modulated_layer_norm_backward(dx, dshift, dscale, dy, x, scale, mean, rstd);
    Tensor dyg = to_gpu(dy, DType::BF16), dxg = to_gpu(dx0, DType::BF16);
    Tensor dshiftg = poisoned_gpu(modulation, DType::BF16), dscaleg = poisoned_gpu(modulation, DType::BF16);
    modulated_layer_norm_backward(dxg, dshiftg, dscaleg, dyg, xg, scaleg, meang, rstdg);
    EXPECT_LT(relative_l2(to_cpu_f32(dxg), dx), kBf16Tolerance) << name(s);
    EXPECT_LT(relative_l2(to_cpu_f32(dshiftg), dshift), kBf16Tolerance) << name(s);
    EXPECT_LT(relative_l2(to_cpu_f32(dscaleg), dscale), kBf16Tolerance) << name(s);

    // Deterministic: the same backward again gives the same bits.
    Tensor dxg2 = to_gpu(dx0, DType::BF16);
    Tensor dshiftg2 = poisoned_gpu(modulation, DType::BF16), dscaleg2 = poisoned_gpu(modulation, DType::BF16);
    modulated_layer_norm_backward(dxg2, dshiftg2, dscaleg2, dyg, xg, scaleg, meang, rstdg);
    EXPECT_EQ(host_values<uint16_t>(dxg2), host_values<uint16_t>(dxg)) << name(s);
    EXPECT_EQ(host_values<uint16_t>(dshiftg2), host_values<uint16_t>(dshiftg)) << name(s);
    EXPECT_EQ(host_values<uint16_t>(dscaleg2), host_values<uint16_t>(dscaleg)) << name(s);
  }
}

TEST(GpuFluxNormOps, GatedResidualMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (const Dims& s : kShapes) {
    const auto [batch, tokens, dim] = s;
    const Shape full{batch, tokens, dim}, modulation{batch, dim};
    Tensor x0 = random_bf16_values(full, rng), y = random_bf16_values(full, rng);
    Tensor gate = random_bf16_values(modulation, rng);
    Tensor x = x0.clone();
    gated_residual_forward(x, y, gate);
    Tensor xg = to_gpu(x0, DType::BF16), yg = to_gpu(y, DType::BF16), gateg = to_gpu(gate, DType::BF16);
    gated_residual_forward(xg, yg, gateg);
    EXPECT_LT(relative_l2(to_cpu_f32(xg), x), kBf16Tolerance) << name(s);

    Tensor dx = random_bf16_values(full, rng);
    Tensor dy = Tensor::empty(full), dgate = Tensor::empty(modulation);
    gated_residual_backward(dy, dgate, dx, y, gate);
    Tensor dxg = to_gpu(dx, DType::BF16);
    Tensor dyg = poisoned_gpu(full, DType::BF16), dgateg = poisoned_gpu(modulation, DType::BF16);
    gated_residual_backward(dyg, dgateg, dxg, yg, gateg);
    EXPECT_LT(relative_l2(to_cpu_f32(dyg), dy), kBf16Tolerance) << name(s);
    EXPECT_LT(relative_l2(to_cpu_f32(dgateg), dgate), kBf16Tolerance) << name(s);

    Tensor dyg2 = poisoned_gpu(full, DType::BF16), dgateg2 = poisoned_gpu(modulation, DType::BF16);
    gated_residual_backward(dyg2, dgateg2, dxg, yg, gateg);
    EXPECT_EQ(host_values<uint16_t>(dyg2), host_values<uint16_t>(dyg)) << name(s);
    EXPECT_EQ(host_values<uint16_t>(dgateg2), host_values<uint16_t>(dgateg)) << name(s);
  }
}

// An elementwise activation against its CPU reference: sizes with a tail of fewer than 8
// elements, FLUX's MLP hidden activation (B = 2, T = 37, 4 x 3072), each also as a view
// that starts one element into its buffer (not 16-byte aligned: the element-by-element path).
template <typename Forward, typename Backward>
void expect_activation_matches_cpu(Forward forward, Backward backward) {
  Rng rng(seed_for_current_test());
  for (const int64_t n : {int64_t{1}, int64_t{105}, int64_t{2 * 37 * 12288}}) {
    for (const int64_t first : {0, 1}) {
      Tensor in = random_bf16_values({n + first}, rng, 3.0), dout = random_bf16_values({n + first}, rng);
      Tensor out = Tensor::empty({n + first}), din = Tensor::empty({n + first});
      forward(out, in);
      backward(din, dout, in);
      Tensor ing = to_gpu(in, DType::BF16).narrow(first, n + first);
      Tensor doutg = to_gpu(dout, DType::BF16).narrow(first, n + first);
      Tensor outg = poisoned_gpu({n + first}, DType::BF16).narrow(first, n + first);
      Tensor ding = poisoned_gpu({n + first}, DType::BF16).narrow(first, n + first);
      forward(outg, ing);
      backward(ding, doutg, ing);
      EXPECT_LT(relative_l2(to_cpu_f32(outg), out.narrow(first, n + first)), kBf16Tolerance) << n << " at " << first;
      EXPECT_LT(relative_l2(to_cpu_f32(ding), din.narrow(first, n + first)), kBf16Tolerance) << n << " at " << first;
    }
  }
}

TEST(GpuFluxNormOps, GeluTanhMatchesCpu) { expect_activation_matches_cpu(gelu_tanh_forward, gelu_tanh_backward); }

TEST(GpuFluxNormOps, SiluMatchesCpu) { expect_activation_matches_cpu(silu_forward, silu_backward); }

// The message of the forge::Error `action` throws, or "" when it throws none.
std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GpuFluxNormOps, RowOpsRejectWidthsNotAMultipleOf8) {
  const Shape full{1, 2, 12}, modulation{1, 12};
  Tensor x = poisoned_gpu(full, DType::BF16), mod = poisoned_gpu(modulation, DType::BF16);
  Tensor stats = poisoned_gpu({1, 2}, DType::F32);
  const std::string norm = error_of([&] { modulated_layer_norm_forward(x, stats, stats, x, mod, mod, 1e-6f); });
  EXPECT_NE(norm.find("modulated_layer_norm_forward: dim 12 must be a multiple of 8"), std::string::npos) << norm;
  const std::string gated = error_of([&] { gated_residual_forward(x, x, mod); });
  EXPECT_NE(gated.find("gated_residual_forward: dim 12 must be a multiple of 8"), std::string::npos) << gated;
}

}  // namespace
}  // namespace forge::gpu_test
