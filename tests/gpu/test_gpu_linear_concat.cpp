// The linear layer over two concatenated inputs (NOTE [Linear over concatenated inputs] in
// ops/linear.h) on the GPU, where its GEMMs read and write column blocks of the weight and
// its gradient in place (NOTE [Column-block GEMMs] in kernels/cuda/matmul.cpp), against
// the CPU reference on random data: FLUX's single-block output projection
// ([attention 3072, GELU(MLP) 12288] -> 3072) and smaller ones, with fresh gradients (the
// fused BIAS / DGELU / BGRADB epilogues) and added ones, heuristic and tuned algorithms.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "gemm_tuning_testing.h"
#include "gpu_testing.h"
#include "ops/gated_residual.h"
#include "ops/gelu.h"
#include "ops/linear.h"
#include "ops/matmul.h"

namespace forge::gpu_test {
namespace {

struct ConcatCase {
  int64_t rows, in1, in2, out;
};

// A small problem, one with odd rows, and FLUX.1-dev's single-block proj_out on 256 tokens.
constexpr ConcatCase kCases[] = {{64, 128, 256, 96}, {301, 136, 512, 200}, {256, 3072, 12288, 3072}};

void fill(const Tensor& t, float v) {
  Tensor host = Tensor::empty(t.shape());
  for (int64_t i = 0; i < host.numel(); ++i) host.data<float>()[i] = v;
  t.copy_from(t.device() == Device::CPU ? host : to_gpu(host, t.dtype()));
}

// Forward and backward of one case on both devices; the CPU reads the GPU's h2 and x2 so
// both differentiate the same values.
void expect_concat_layer_matches_cpu(const ConcatCase& c, Rng& rng) {
  const std::string what = fmt::format("[{} + {}] -> {} on {} rows", c.in1, c.in2, c.out, c.rows);
  const int64_t in = c.in1 + c.in2;
  const Tensor x1 = random_bf16_values({c.rows, c.in1}, rng), h2 = random_bf16_values({c.rows, c.in2}, rng, 2.0);
  const Tensor w = random_bf16_values({c.out, in}, rng, 0.03), b = random_bf16_values({c.out}, rng);
  const Tensor dy = random_bf16_values({c.rows, c.out}, rng);
  const Tensor x1_g = to_gpu(x1, DType::BF16), h2_g = to_gpu(h2, DType::BF16), dy_g = to_gpu(dy, DType::BF16);
  Tensor x2_g = poisoned_gpu({c.rows, c.in2}, DType::BF16);
  gelu_tanh_forward(x2_g, h2_g);
  const Tensor x2 = to_cpu_f32(x2_g);
  const LinearWeight l{.weight = w, .bias = b};
  const LinearWeight l_g{.weight = to_gpu(w, DType::BF16), .bias = to_gpu(b, DType::BF16)};

  Tensor y = Tensor::empty({c.rows, c.out}), y_g = poisoned_gpu({c.rows, c.out}, DType::BF16);
  linear_concat_forward(y, x1, x2, l);
  linear_concat_forward(y_g, x1_g, x2_g, l_g);
  EXPECT_LT(relative_l2(to_cpu_f32(y_g), y), kBf16Tolerance) << what << " forward";

  for (const bool overwrite : {true, false}) {
    const std::string how = what + (overwrite ? ", gradients written over" : ", gradients added to");
    Tensor dx1 = Tensor::empty({c.rows, c.in1}), dh2 = Tensor::empty({c.rows, c.in2});
    Tensor da2 = Tensor::empty({c.rows, c.in2});
    LinearWeight g{.weight = Tensor::empty({c.out, in}), .bias = Tensor::empty({c.out})};
    Tensor dx1_g = poisoned_gpu({c.rows, c.in1}, DType::BF16), dh2_g = poisoned_gpu({c.rows, c.in2}, DType::BF16);
    Tensor da2_g = poisoned_gpu({c.rows, c.in2}, DType::BF16);
    LinearWeight g_g{.weight = Tensor::empty({c.out, in}, DType::F32, Device::CUDA),
                     .bias = Tensor::empty({c.out}, DType::F32, Device::CUDA)};
    for (const LinearWeight* gw : {&g, &g_g}) {
      fill(gw->weight, 0.5f);
      fill(gw->bias, 0.5f);
    }
    linear_concat_gelu_backward(dx1, dh2, da2, g, dy, x1, x2, l, h2, overwrite);
    linear_concat_gelu_backward(dx1_g, dh2_g, da2_g, g_g, dy_g, x1_g, x2_g, l_g, h2_g, overwrite);
    EXPECT_LT(relative_l2(to_cpu_f32(dx1_g), dx1), kBf16Tolerance) << how << ": dx1";
    EXPECT_LT(relative_l2(to_cpu_f32(dh2_g), dh2), kBf16Tolerance) << how << ": dh2";
    EXPECT_LT(relative_l2(to_cpu_f32(g_g.weight), g.weight), kF32Tolerance) << how << ": dW";
    EXPECT_LT(relative_l2(to_cpu_f32(g_g.bias), g.bias), kF32Tolerance) << how << ": db";
  }
}

TEST(GpuLinearConcat, SingleBlockProjectionMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (const ConcatCase& c : kCases) expect_concat_layer_matches_cpu(c, rng);
}

// cuBLASLt fuses each epilogue the op relies on with a column block on FLUX's layouts (the
// bias with the weight's first block read, GELU's derivative with its second, the bias
// gradient with the gradient's first block written), and the block GEMMs leave the rest of
// the matrix alone.
TEST(GpuLinearConcat, ColumnBlockEpiloguesFuseOnFluxLayouts) {
  Rng rng(seed_for_current_test());
  const int64_t rows = 256, in1 = 3072, in2 = 12288, out = 3072, in = in1 + in2;
  const Tensor w_g = to_gpu(random_bf16_values({out, in}, rng, 0.03), DType::BF16);
  const Tensor x1_g = to_gpu(random_bf16_values({rows, in1}, rng), DType::BF16);
  const Tensor h2_g = to_gpu(random_bf16_values({rows, in2}, rng), DType::BF16);
  const Tensor dy_g = to_gpu(random_bf16_values({rows, out}, rng), DType::BF16);
  const Tensor b_g = to_gpu(random_bf16_values({out}, rng), DType::BF16);
  Tensor y_g = poisoned_gpu({rows, out}, DType::BF16), dh2_g = poisoned_gpu({rows, in2}, DType::BF16);
  EXPECT_TRUE(matmul_blocks_epilogue(MatmulEpilogue::Bias, all_columns(y_g), x1_g, false,
                                     column_block(w_g, 0, in1), true, 0.0f, nullptr, b_g));
  EXPECT_TRUE(matmul_blocks_epilogue(MatmulEpilogue::DGelu, all_columns(dh2_g), dy_g, false,
                                     column_block(w_g, in1, in2), false, 0.0f, nullptr, Tensor(), &h2_g));
  Tensor dw_g = Tensor::empty({out, in}, DType::F32, Device::CUDA), db_g = poisoned_gpu({out}, DType::F32);
  fill(dw_g, 0.25f);
  EXPECT_TRUE(matmul_blocks_epilogue(MatmulEpilogue::BiasGradient, column_block(dw_g, 0, in1), dy_g, true,
                                     all_columns(x1_g), false, 0.0f, nullptr, db_g));
  // The second block of dW still holds 0.25 everywhere; the first was written.
  const Tensor dw = to_cpu_f32(dw_g);
  int64_t untouched_wrong = 0, written_left = 0;
  for (int64_t r = 0; r < out; ++r) {
    for (int64_t col = in1; col < in; col += 97) untouched_wrong += dw.data<float>()[r * in + col] != 0.25f;
    for (int64_t col = 0; col < in1; col += 97) written_left += dw.data<float>()[r * in + col] == 0.25f;
  }
  EXPECT_EQ(untouched_wrong, 0);
  EXPECT_LT(written_left, 8);  // a written value equal to 0.25 by chance is rare
}

// With measured algorithm choice (training.gemm_tuning) the column-block GEMMs are timed
// and cached under their own keys (GemmProblem::ld_b, ld_out) and still match the CPU.
class GpuLinearConcatTuned : public GemmTuningTest {};

TEST_F(GpuLinearConcatTuned, MatchesCpuWithTunedAlgorithms) {
  Rng rng(seed_for_current_test());
  expect_concat_layer_matches_cpu(ConcatCase{301, 136, 512, 200}, rng);
  expect_concat_layer_matches_cpu(ConcatCase{256, 3072, 12288, 3072}, rng);
  EXPECT_GT(gemm_tuning_stats().shapes_tuned, 0);
}

// out = x + gate * y into a separate output (the FLUX blocks' residual stream, NOTE in
// ops/gated_residual.h): the in-place op's values, x untouched.
TEST(GpuLinearConcat, GatedResidualIntoASeparateOutputMatchesCpu) {
  Rng rng(seed_for_current_test());
  const Shape full{1, 4608, 3072}, modulation{1, 3072};
  const Tensor x = random_bf16_values(full, rng), y = random_bf16_values(full, rng);
  const Tensor gate = random_bf16_values(modulation, rng);
  Tensor want = x.clone();
  gated_residual_forward(want, y, gate);
  const Tensor x_g = to_gpu(x, DType::BF16), y_g = to_gpu(y, DType::BF16), gate_g = to_gpu(gate, DType::BF16);
  Tensor out_g = poisoned_gpu(full, DType::BF16);
  gated_residual_forward(out_g, x_g, y_g, gate_g);
  EXPECT_LT(relative_l2(to_cpu_f32(out_g), want), kBf16Tolerance);
  EXPECT_EQ(host_values<uint16_t>(x_g), host_values<uint16_t>(to_gpu(x, DType::BF16)));
  Tensor in_place_g = to_gpu(x, DType::BF16);
  gated_residual_forward(in_place_g, y_g, gate_g);
  EXPECT_EQ(host_values<uint16_t>(out_g), host_values<uint16_t>(in_place_g));
}

}  // namespace
}  // namespace forge::gpu_test
