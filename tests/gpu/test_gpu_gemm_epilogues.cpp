// GEMMs with fused epilogues (NOTE [GEMM epilogues] in kernels/cuda/matmul.cpp) on the GPU
// against the CPU reference's separate ops on fresh random data: the bias added in the
// GEMM, the bias gradient taken with the weight gradient, GELU (tanh) with its
// pre-activation kept, and GELU's derivative; then
// the linear ops that use them (NOTE [Linear bias], NOTE [GELU after a linear layer] in
// ops/linear.h), fused and, where they cannot fuse (gradients added to), unfused.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "gpu_testing.h"
#include "ops/bias.h"
#include "ops/elementwise.h"
#include "ops/gelu.h"
#include "ops/linear.h"
#include "ops/matmul.h"

namespace forge::gpu_test {
namespace {

struct GemmCase {
  int64_t rows, in, out;
};

// A small problem, one with odd row counts, and FLUX.1-dev's MLP (3072 -> 12288) on 600 tokens.
constexpr GemmCase kCases[] = {{64, 128, 96}, {301, 200, 136}, {600, 3072, 12288}};

// cuBLASLt fuses each epilogue on FLUX's layouts: the forward's y = x W^T (+ b, + GELU), the
// weight gradient's dW = dy^T x (+ bias gradient) and the input gradient's dx = dy W
// (+ GELU's derivative). Each result against the
// CPU's unfused ops.
TEST(GpuGemmEpilogues, EachEpilogueFusesAndMatchesTheSeparateOps) {
  Rng rng(seed_for_current_test());
  for (const GemmCase& c : kCases) {
    const std::string what = fmt::format("{} x {} -> {}", c.rows, c.in, c.out);
    const Tensor x = random_bf16_values({c.rows, c.in}, rng);
    const Tensor w = random_bf16_values({c.out, c.in}, rng, 0.05);
    const Tensor b = random_bf16_values({c.out}, rng);
    const Tensor x_g = to_gpu(x, DType::BF16), w_g = to_gpu(w, DType::BF16), b_g = to_gpu(b, DType::BF16);

    // Bias, with and without a residual addend.
    const Tensor residual = random_bf16_values({c.rows, c.out}, rng);
    for (const bool with_residual : {false, true}) {
      Tensor y = Tensor::empty({c.rows, c.out});
      matmul(y, x, false, w, true);
      if (with_residual) accumulate(y, residual);
      add_bias(y, b);
      Tensor y_g = poisoned_gpu({c.rows, c.out}, DType::BF16);
      const Tensor residual_g = to_gpu(residual, DType::BF16);
      ASSERT_TRUE(matmul_epilogue(MatmulEpilogue::Bias, y_g, x_g, false, w_g, true, with_residual ? 1.0f : 0.0f,
                                  with_residual ? &residual_g : nullptr, b_g))
          << what;
      EXPECT_LT(relative_l2(to_cpu_f32(y_g), y), kBf16Tolerance) << what << " bias, residual " << with_residual;
    }

    // GELU_AUX_BIAS: a = gelu(h), h = x W^T + b.
    Tensor h = Tensor::empty({c.rows, c.out}), a = Tensor::empty({c.rows, c.out});
    matmul(h, x, false, w, true);
    add_bias(h, b);
    gelu_tanh_forward(a, h);
    Tensor h_g = poisoned_gpu({c.rows, c.out}, DType::BF16), a_g = poisoned_gpu({c.rows, c.out}, DType::BF16);
    ASSERT_TRUE(matmul_epilogue(MatmulEpilogue::GeluAuxBias, a_g, x_g, false, w_g, true, 0.0f, nullptr, b_g, &h_g))
        << what;
    EXPECT_LT(relative_l2(to_cpu_f32(h_g), h), kBf16Tolerance) << what << " pre-activation";
    EXPECT_LT(relative_l2(to_cpu_f32(a_g), a), kBf16Tolerance) << what << " gelu";

    // BGRADB: dW = dy^T x with db = column sums of dy.
    const Tensor dy = random_bf16_values({c.rows, c.out}, rng);
    const Tensor dy_g = to_gpu(dy, DType::BF16);
    Tensor dw = Tensor::empty({c.out, c.in}), db = Tensor::empty({c.out});
    matmul(dw, dy, true, x, false);
    bias_gradient(db, dy, true);
    Tensor dw_g = poisoned_gpu({c.out, c.in}, DType::F32), db_g = poisoned_gpu({c.out}, DType::F32);
    ASSERT_TRUE(matmul_epilogue(MatmulEpilogue::BiasGradient, dw_g, dy_g, true, x_g, false, 0.0f, nullptr, db_g))
        << what;
    EXPECT_LT(relative_l2(to_cpu_f32(dw_g), dw), kF32Tolerance) << what << " weight gradient";
    EXPECT_LT(relative_l2(to_cpu_f32(db_g), db), kF32Tolerance) << what << " bias gradient";

    // DGELU: dh = (dz W2) * gelu'(h) with dz [rows, out2], W2 [out2, out].
    const int64_t out2 = c.in;
    const Tensor dz = random_bf16_values({c.rows, out2}, rng);
    const Tensor w2 = random_bf16_values({out2, c.out}, rng, 0.05);
    const Tensor h_cpu = to_cpu_f32(h_g);  // the GPU's pre-activation, so both sides differentiate the same h
    Tensor da = Tensor::empty({c.rows, c.out}), dh = Tensor::empty({c.rows, c.out});
    matmul(da, dz, false, w2, false);
    gelu_tanh_backward(dh, da, h_cpu);
    Tensor dh_g = poisoned_gpu({c.rows, c.out}, DType::BF16);
    ASSERT_TRUE(matmul_epilogue(MatmulEpilogue::DGelu, dh_g, to_gpu(dz, DType::BF16), false, to_gpu(w2, DType::BF16),
                                false, 0.0f, nullptr, Tensor(), &h_g))
        << what;
    EXPECT_LT(relative_l2(to_cpu_f32(dh_g), dh), kBf16Tolerance) << what << " gelu gradient";
  }
}

// A GELU MLP through the linear ops, h = x W1^T + b1, a = gelu(h), y = a W2^T + b2, forward
// and backward against the CPU: with fresh gradients (fused on the GPU) and with gradients
// added to (the separate passes), the results agree either way.
TEST(GpuGemmEpilogues, GeluMlpThroughTheLinearOpsMatchesCpu) {
  Rng rng(seed_for_current_test());
  const int64_t rows = 257, d = 128, m = 512;
  const Tensor x = random_bf16_values({rows, d}, rng), dy = random_bf16_values({rows, d}, rng);
  const Tensor w1 = random_bf16_values({m, d}, rng, 0.08), b1 = random_bf16_values({m}, rng);
  const Tensor w2 = random_bf16_values({d, m}, rng, 0.05), b2 = random_bf16_values({d}, rng);
  const LinearWeight l1{.weight = w1, .bias = b1}, l2{.weight = w2, .bias = b2};
  const LinearWeight l1_g{.weight = to_gpu(w1, DType::BF16), .bias = to_gpu(b1, DType::BF16)};
  const LinearWeight l2_g{.weight = to_gpu(w2, DType::BF16), .bias = to_gpu(b2, DType::BF16)};
  const Tensor x_g = to_gpu(x, DType::BF16), dy_g = to_gpu(dy, DType::BF16);

  Tensor h = Tensor::empty({rows, m}), a = Tensor::empty({rows, m}), y = Tensor::empty({rows, d});
  linear_gelu_forward(a, h, x, l1);
  linear_forward(y, a, l2);
  Tensor h_g = poisoned_gpu({rows, m}, DType::BF16), a_g = poisoned_gpu({rows, m}, DType::BF16);
  Tensor y_g = poisoned_gpu({rows, d}, DType::BF16);
  linear_gelu_forward(a_g, h_g, x_g, l1_g);
  linear_forward(y_g, a_g, l2_g);
  EXPECT_LT(relative_l2(to_cpu_f32(a_g), a), kBf16Tolerance);
  EXPECT_LT(relative_l2(to_cpu_f32(y_g), y), kBf16Tolerance);

  for (const bool overwrite : {true, false}) {
    const std::string what = overwrite ? "written over" : "added to";
    auto fill = [&](const Tensor& t, float v) {
      Tensor host = Tensor::empty(t.shape());
      for (int64_t i = 0; i < host.numel(); ++i) host.data<float>()[i] = v;
      t.copy_from(t.device() == Device::CPU ? host : to_gpu(host, t.dtype()));
    };
    // CPU reference: separate ops (CPU tensors never fuse), into buffers holding 0.5.
    Tensor dh = Tensor::empty({rows, m}), da = Tensor::empty({rows, m}), dx = Tensor::empty({rows, d});
    LinearWeight g1{.weight = Tensor::empty({m, d}), .bias = Tensor::empty({m})};
    LinearWeight g2{.weight = Tensor::empty({d, m}), .bias = Tensor::empty({d})};
    Tensor dh_g = poisoned_gpu({rows, m}, DType::BF16), da_g = poisoned_gpu({rows, m}, DType::BF16);
    Tensor dx_g = poisoned_gpu({rows, d}, DType::BF16);
    LinearWeight g1_g{.weight = Tensor::empty({m, d}, DType::F32, Device::CUDA),
                      .bias = Tensor::empty({m}, DType::F32, Device::CUDA)};
    LinearWeight g2_g{.weight = Tensor::empty({d, m}, DType::F32, Device::CUDA),
                      .bias = Tensor::empty({d}, DType::F32, Device::CUDA)};
    for (const LinearWeight* g : {&g1, &g2, &g1_g, &g2_g}) {
      fill(g->weight, 0.5f);
      fill(g->bias, 0.5f);
    }
    auto backward = [&](const Tensor& dh_, const Tensor& da_, const Tensor& dx_, const LinearWeight& g1_,
                        const LinearWeight& g2_, const Tensor& dy_, const Tensor& a_, const Tensor& h_,
                        const Tensor& x_, const LinearWeight& l1_, const LinearWeight& l2_) {
      linear_gelu_backward(dh_, da_, g2_, dy_, a_, l2_, h_, overwrite);
      linear_backward(dx_, g1_, dh_, x_, l1_, overwrite);
    };
    backward(dh, da, dx, g1, g2, dy, to_cpu_f32(a_g), to_cpu_f32(h_g), x, l1, l2);  // the GPU's a and h
    backward(dh_g, da_g, dx_g, g1_g, g2_g, dy_g, a_g, h_g, x_g, l1_g, l2_g);
    EXPECT_LT(relative_l2(to_cpu_f32(dh_g), dh), kBf16Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(dx_g), dx), kBf16Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(g1_g.weight), g1.weight), kBf16Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(g1_g.bias), g1.bias), kBf16Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(g2_g.weight), g2.weight), kF32Tolerance) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(g2_g.bias), g2.bias), kF32Tolerance) << what;
  }
}

}  // namespace
}  // namespace forge::gpu_test
