// Every CUDA op against the CPU reference op on fresh random data, at several shapes
// including awkward ones (a single row, odd row counts, vocabularies that are not
// multiples of anything). See gpu_testing.h for the method.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "gpu_testing.h"
#include "ops/adamw.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

namespace forge::gpu_test {
namespace {

struct GemmCase {
  int64_t m, n, k;
};

TEST(GpuMatmul, MatchesCpuForAllTransposesAndOutputs) {
  Rng rng(seed_for_current_test());
  for (GemmCase c : {GemmCase{1, 8, 8}, GemmCase{7, 24, 40}, GemmCase{33, 64, 16}, GemmCase{512, 384, 1024},
                     GemmCase{1000, 200, 72}}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        Tensor a = random_bf16_values(ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, rng);
        Tensor b = random_bf16_values(tb ? Shape{c.n, c.k} : Shape{c.k, c.n}, rng);
        Tensor ref = Tensor::empty({c.m, c.n});
        matmul(ref, a, ta, b, tb);
        Tensor out = poisoned_gpu({c.m, c.n}, DType::BF16);
        matmul(out, to_gpu(a, DType::BF16), ta, to_gpu(b, DType::BF16), tb);
        EXPECT_LT(relative_l2(to_cpu_f32(out), ref), kBf16Tolerance) << c.m << "x" << c.n << "x" << c.k << " " << ta << tb;

        // fp32 output accumulating into existing values (weight gradients): beta = 1.
        Tensor acc = random_f32({c.m, c.n}, rng);
        Tensor acc_gpu = acc.to(Device::CUDA);
        matmul(acc, a, ta, b, tb, 0.5f, 1.0f);
        matmul(acc_gpu, to_gpu(a, DType::BF16), ta, to_gpu(b, DType::BF16), tb, 0.5f, 1.0f);
        EXPECT_LT(relative_l2(to_cpu_f32(acc_gpu), acc), kF32Tolerance) << "accumulate " << ta << tb;

        // A residual added from its own buffer (the GEMM's C operand), both output dtypes.
        Tensor residual = random_bf16_values({c.m, c.n}, rng);
        Tensor sum = residual.clone();
        matmul(sum, a, ta, b, tb, 1.0f, 1.0f);
        for (DType dtype : {DType::BF16, DType::F32}) {
          Tensor residual_gpu = to_gpu(residual, dtype), out_add = poisoned_gpu({c.m, c.n}, dtype);
          matmul_add(out_add, to_gpu(a, DType::BF16), ta, to_gpu(b, DType::BF16), tb, residual_gpu);
          EXPECT_LT(relative_l2(to_cpu_f32(out_add), sum), kBf16Tolerance) << "addend " << ta << tb;
          EXPECT_EQ(relative_l2(to_cpu_f32(residual_gpu), residual), 0.0) << "the addend is left as it was";
        }
      }
    }
  }
}

// Measured algorithm choice (NOTE [GEMM algorithm choice]) times candidates on the call's
// own operands: the call's result must still be one product, written once (beta = 1 adds it
// once to what was there), whatever candidate wins, and each beta gets its own choice.
// NOTE [GEMMs of varying size]: sizes that share a bucket's plan (and some that do not),
// in each of the three uses (an expert's forward and input gradient vary M, its weight
// gradient K, written over and accumulated), against the CPU.
TEST(GpuMatmul, VaryingSizesShareAPlanAndMatchCpu) {
  Rng rng(seed_for_current_test());
  const int64_t n = 384, k = 136;
  for (int64_t rows : {300, 290, 511, 257, 1, 7, 256, 600, 300}) {
    for (int use = 0; use < 3; ++use) {
      const bool weight_gradient = use == 2;
      const Tensor x = random_bf16_values({rows, weight_gradient ? k : n}, rng);
      const Tensor w = random_bf16_values(use == 0 ? Shape{n, k} : use == 1 ? Shape{n, k} : Shape{rows, n}, rng);
      // forward: y[rows, n] = x[rows, k] W[n, k]^T; input gradient: dx[rows, k] = dy[rows, n] W[n, k];
      // weight gradient: dW[n, k] (+)= dy[rows, n]^T x[rows, k].
      if (use == 0) {
        const Tensor in = random_bf16_values({rows, k}, rng);
        Tensor ref = Tensor::empty({rows, n});
        matmul(ref, in, false, w, true);
        Tensor out = poisoned_gpu({rows, n}, DType::BF16);
        matmul_varying(GemmVarying::M, out, to_gpu(in, DType::BF16), false, to_gpu(w, DType::BF16), true);
        EXPECT_LT(relative_l2(to_cpu_f32(out), ref), kBf16Tolerance) << "forward, rows " << rows;
      } else if (use == 1) {
        Tensor ref = Tensor::empty({rows, k});
        matmul(ref, x, false, w, false);
        Tensor out = poisoned_gpu({rows, k}, DType::BF16);
        matmul_varying(GemmVarying::M, out, to_gpu(x, DType::BF16), false, to_gpu(w, DType::BF16), false);
        EXPECT_LT(relative_l2(to_cpu_f32(out), ref), kBf16Tolerance) << "input gradient, rows " << rows;
      } else {
        Tensor acc = random_f32({n, k}, rng);
        Tensor acc_gpu = acc.to(Device::CUDA);
        matmul(acc, w, true, x, false, 1.0f, 1.0f);
        matmul_varying(GemmVarying::K, acc_gpu, to_gpu(w, DType::BF16), true, to_gpu(x, DType::BF16), false, 1.0f,
                       1.0f);
        EXPECT_LT(relative_l2(to_cpu_f32(acc_gpu), acc), kF32Tolerance) << "weight gradient added, rows " << rows;
        Tensor fresh = Tensor::empty({n, k});
        matmul(fresh, w, true, x, false);
        Tensor fresh_gpu = poisoned_gpu({n, k}, DType::F32);
        matmul_varying(GemmVarying::K, fresh_gpu, to_gpu(w, DType::BF16), true, to_gpu(x, DType::BF16), false);
        EXPECT_LT(relative_l2(to_cpu_f32(fresh_gpu), fresh), kF32Tolerance) << "weight gradient, rows " << rows;
      }
    }
  }
}

// NOTE [Batched GEMMs]: one batched call against the CPU's product of each matrix, in the MoE
// experts' three uses (forward, input gradient, weight gradient written over and added), at
// a padded expert's shapes (8 experts of 96 rows).
TEST(GpuMatmul, BatchedMatchesCpuInTheExpertsUses) {
  Rng rng(seed_for_current_test());
  const int64_t experts = 8, rows = 96, n = 384, k = 136;
  const Tensor x = random_bf16_values({experts, rows, k}, rng), w = random_bf16_values({experts, n, k}, rng);
  const Tensor dy = random_bf16_values({experts, rows, n}, rng);
  Tensor y = Tensor::empty({experts, rows, n});
  matmul_batched(y, x, false, w, true);
  Tensor y_gpu = poisoned_gpu({experts, rows, n}, DType::BF16);
  matmul_batched(y_gpu, to_gpu(x, DType::BF16), false, to_gpu(w, DType::BF16), true);
  EXPECT_LT(relative_l2(to_cpu_f32(y_gpu), y), kBf16Tolerance) << "forward";
  Tensor dx = Tensor::empty({experts, rows, k});
  matmul_batched(dx, dy, false, w, false);
  Tensor dx_gpu = poisoned_gpu({experts, rows, k}, DType::BF16);
  matmul_batched(dx_gpu, to_gpu(dy, DType::BF16), false, to_gpu(w, DType::BF16), false);
  EXPECT_LT(relative_l2(to_cpu_f32(dx_gpu), dx), kBf16Tolerance) << "input gradient";
  for (const float beta : {0.0f, 1.0f}) {
    Tensor dw = random_f32({experts, n, k}, rng);
    Tensor dw_gpu = beta == 0.0f ? poisoned_gpu({experts, n, k}, DType::F32) : dw.to(Device::CUDA);
    matmul_batched(dw, dy, true, x, false, 1.0f, beta);
    matmul_batched(dw_gpu, to_gpu(dy, DType::BF16), true, to_gpu(x, DType::BF16), false, 1.0f, beta);
    EXPECT_LT(relative_l2(to_cpu_f32(dw_gpu), dw), kF32Tolerance) << "weight gradient, beta " << beta;
  }
}

TEST(GpuMatmul, TunedChoiceComputesTheSameProduct) {
  Rng rng(seed_for_current_test());
  set_gemm_tuning(true);
  for (GemmCase c : {GemmCase{256, 384, 512}, GemmCase{1000, 200, 72}, GemmCase{2048, 1024, 768}}) {
    for (bool ta : {false, true}) {
      Tensor a = random_bf16_values(ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, rng);
      Tensor b = random_bf16_values({c.n, c.k}, rng);
      Tensor ag = to_gpu(a, DType::BF16), bg = to_gpu(b, DType::BF16);
      Tensor ref = Tensor::empty({c.m, c.n});
      matmul(ref, a, ta, b, true);
      Tensor out = poisoned_gpu({c.m, c.n}, DType::BF16);
      matmul(out, ag, ta, bg, true);
      EXPECT_LT(relative_l2(to_cpu_f32(out), ref), kBf16Tolerance) << c.m << "x" << c.n << "x" << c.k << " " << ta;

      Tensor acc = random_f32({c.m, c.n}, rng);
      Tensor acc_gpu = acc.to(Device::CUDA);
      Tensor fresh = poisoned_gpu({c.m, c.n}, DType::F32);
      matmul(fresh, ag, ta, bg, true, 1.0f, 0.0f);  // tunes the beta-0 plan
      matmul(acc, a, ta, b, true, 1.0f, 1.0f);
      matmul(acc_gpu, ag, ta, bg, true, 1.0f, 1.0f);  // tunes the beta-1 plan on its own operands
      EXPECT_LT(relative_l2(to_cpu_f32(fresh), ref), kBf16Tolerance) << "beta 0";
      EXPECT_LT(relative_l2(to_cpu_f32(acc_gpu), acc), kF32Tolerance) << "beta 1 adds the product once";
    }
  }
  set_gemm_tuning(false);
}

// The linear op family through its weight descriptor computes, bit for bit, what the
// direct GEMM calls compute: the same shapes reach the same cuBLASLt plan.
TEST(GpuLinear, DescriptorPathEqualsDirectGemmBitwise) {
  Rng rng(seed_for_current_test());
  auto same_bits = [](const Tensor& a, const Tensor& b) {
    const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
    return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
  };
  for (GemmCase c : {GemmCase{1, 8, 8}, GemmCase{33, 64, 16}, GemmCase{1000, 200, 72}, GemmCase{2048, 1024, 768}}) {
    const int64_t tokens = c.m, out = c.n, in = c.k;
    const Tensor x = to_gpu(random_bf16_values({tokens, in}, rng), DType::BF16);
    const Tensor w = to_gpu(random_bf16_values({out, in}, rng), DType::BF16);
    const Tensor dy = to_gpu(random_bf16_values({tokens, out}, rng), DType::BF16);
    const Tensor residual = to_gpu(random_bf16_values({tokens, out}, rng), DType::BF16);
    const LinearWeight weight{w};
    Tensor y = poisoned_gpu({tokens, out}, DType::BF16), y_direct = poisoned_gpu({tokens, out}, DType::BF16);
    linear_forward(y, x, weight);
    matmul(y_direct, x, false, w, true);
    EXPECT_TRUE(same_bits(y, y_direct)) << "forward " << tokens << "x" << out << "x" << in;
    linear_forward(y, x, weight, &residual);
    matmul_add(y_direct, x, false, w, true, residual);
    EXPECT_TRUE(same_bits(y, y_direct)) << "forward with a residual";
    Tensor dx = poisoned_gpu({tokens, in}, DType::BF16), dx_direct = poisoned_gpu({tokens, in}, DType::BF16);
    linear_backward_input(dx, dy, weight);
    matmul(dx_direct, dy, false, w, false);
    EXPECT_TRUE(same_bits(dx, dx_direct)) << "input gradient";
    Tensor dw = poisoned_gpu({out, in}, DType::F32), dw_direct = poisoned_gpu({out, in}, DType::F32);
    linear_backward_weight(LinearWeight{dw}, dy, x, /*overwrite=*/true);
    matmul(dw_direct, dy, true, x, false, 1.0f, 0.0f);
    EXPECT_TRUE(same_bits(dw, dw_direct)) << "weight gradient written over";
    linear_backward_weight(LinearWeight{dw}, dy, x, /*overwrite=*/false);
    matmul(dw_direct, dy, true, x, false, 1.0f, 1.0f);
    EXPECT_TRUE(same_bits(dw, dw_direct)) << "weight gradient added";
  }
}

TEST(GpuRmsnorm, ForwardAndBackwardMatchCpu) {
  Rng rng(seed_for_current_test());
  // Every row layout of kernels/cuda/rmsnorm.cu: rows narrower than a warp (8, 24, 64), one
  // and several rows per block, an odd width (4104), the 8B/70B/405B widths, and rows too
  // wide for registers (16392: two slabs, the second holding one vector). Row counts leave
  // partial blocks and partial last steps in the backward's row ranges (1003 and 530 give
  // several steps per block).
  for (auto [rows, dim] : {std::pair<int64_t, int64_t>{1, 8}, {7, 24}, {37, 64}, {1000, 4104}, {1003, 4096},
                           {1025, 2048}, {67, 8192}, {33, 16384}, {530, 16392}}) {
    Tensor x = random_bf16_values({rows, dim}, rng), w = random_bf16_values({dim}, rng, 0.5);
    Tensor y = Tensor::empty({rows, dim}), rstd = Tensor::empty({rows});
    rmsnorm_forward(y, rstd, x, w, 1e-5f);
    Tensor xg = to_gpu(x, DType::BF16), wg = to_gpu(w, DType::BF16);
    Tensor yg = poisoned_gpu({rows, dim}, DType::BF16), rstdg = poisoned_gpu({rows}, DType::F32);
    rmsnorm_forward(yg, rstdg, xg, wg, 1e-5f);
    EXPECT_LT(relative_l2(to_cpu_f32(yg), y), kBf16Tolerance) << rows << "x" << dim;
    EXPECT_LT(relative_l2(to_cpu_f32(rstdg), rstd), kF32Tolerance);

    Tensor dy = random_bf16_values({rows, dim}, rng), dx0 = random_bf16_values({rows, dim}, rng);
    Tensor dw0 = random_f32({dim}, rng);
    Tensor dx = dx0.clone(), dw = dw0.clone();
    rmsnorm_backward(dx, dw, dy, x, w, rstd);
    Tensor dxg = to_gpu(dx0, DType::BF16), dwg = dw0.to(Device::CUDA);
    Tensor dyg = to_gpu(dy, DType::BF16);
    rmsnorm_backward(dxg, dwg, dyg, xg, wg, rstdg);
    EXPECT_LT(relative_l2(to_cpu_f32(dxg), dx), kBf16Tolerance) << rows << "x" << dim;
    EXPECT_LT(relative_l2(to_cpu_f32(dwg), dw), kF32Tolerance) << rows << "x" << dim;

    // Deterministic: the same accumulation again gives the same bits.
    Tensor dxg2 = to_gpu(dx0, DType::BF16), dwg2 = dw0.to(Device::CUDA);
    rmsnorm_backward(dxg2, dwg2, dyg, xg, wg, rstdg);
    EXPECT_EQ(relative_l2(to_cpu_f32(dxg2), to_cpu_f32(dxg)), 0.0) << rows << "x" << dim;
    EXPECT_EQ(relative_l2(to_cpu_f32(dwg2), to_cpu_f32(dwg)), 0.0) << rows << "x" << dim;
  }
}

TEST(GpuSwiglu, ForwardAndBackwardMatchCpu) {
  Rng rng(seed_for_current_test());
  for (auto [rows, ffn] : {std::pair<int64_t, int64_t>{1, 8}, {45, 192}, {513, 14336}}) {
    Tensor gu = random_bf16_values({rows, 2 * ffn}, rng, 2.0), dout = random_bf16_values({rows, ffn}, rng);
    Tensor out = Tensor::empty({rows, ffn}), dgu = Tensor::empty({rows, 2 * ffn});
    swiglu_forward(out, gu);
    swiglu_backward(dgu, dout, gu);
    Tensor gug = to_gpu(gu, DType::BF16);
    Tensor outg = poisoned_gpu({rows, ffn}, DType::BF16), dgug = poisoned_gpu({rows, 2 * ffn}, DType::BF16);
    swiglu_forward(outg, gug);
    swiglu_backward(dgug, to_gpu(dout, DType::BF16), gug);
    EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance);
    EXPECT_LT(relative_l2(to_cpu_f32(dgug), dgu), kBf16Tolerance);
  }
}

TEST(GpuRope, ForwardAndBackwardMatchCpuWithLlama3Scaling) {
  Rng rng(seed_for_current_test());
  RopeScaling scaling{true, 8.0, 1.0, 4.0, 64};
  for (auto [b, t, hq, hkv, d] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{1, 1, 2, 1, 8},
                                  {2, 33, 6, 2, 64}, {1, 300, 32, 8, 128}}) {
    Tensor cos, sin;
    rope_tables(cos, sin, rope_inv_freq(d, 500000.0, scaling), t);
    int64_t heads = hq + 2 * hkv;
    Tensor x = random_bf16_values({b, t, heads, d}, rng);
    Tensor ref = x.clone();
    rope_forward(ref, hq + hkv, cos, sin);
    Tensor xg = to_gpu(x, DType::BF16), cg = cos.to(Device::CUDA), sg = sin.to(Device::CUDA);
    rope_forward(xg, hq + hkv, cg, sg);
    EXPECT_LT(relative_l2(to_cpu_f32(xg), ref), kBf16Tolerance);
    rope_backward(ref, hq + hkv, cos, sin);
    rope_backward(xg, hq + hkv, cg, sg);
    EXPECT_LT(relative_l2(to_cpu_f32(xg), ref), kBf16Tolerance);
  }
}

TEST(GpuEmbedding, ForwardAndBackwardMatchCpu) {
  Rng rng(seed_for_current_test());
  for (auto [count, vocab, hidden] : {std::tuple<int64_t, int64_t, int64_t>{1, 5, 8}, {77, 13, 64}, {2048, 32000, 512}}) {
    Tensor table = random_bf16_values({vocab, hidden}, rng);
    Tensor ids = random_ids(count, vocab, rng);
    Tensor out = Tensor::empty({count, hidden});
    embedding_forward(out, ids, table);
    Tensor idsg = ids.to(Device::CUDA), outg = poisoned_gpu({count, hidden}, DType::BF16);
    embedding_forward(outg, idsg, to_gpu(table, DType::BF16));
    EXPECT_EQ(relative_l2(to_cpu_f32(outg), out), 0.0);

    Tensor dout = random_bf16_values({count, hidden}, rng), d0 = random_f32({vocab, hidden}, rng);
    Tensor dtable = d0.clone(), dtableg = d0.to(Device::CUDA);
    embedding_backward(dtable, dout, ids);
    embedding_backward(dtableg, to_gpu(dout, DType::BF16), idsg);
    EXPECT_LT(relative_l2(to_cpu_f32(dtableg), dtable), 1e-6);
  }
}

// Token ids for the backward's grouping (kernels/cuda/embedding.cu): one token at every
// position, every token once (a shuffle of [0, vocab)), or random with the first positions
// taking the largest id and 0 and the last one 0 again.
enum class IdPattern { Same, Distinct, Random };

Tensor pattern_ids(IdPattern pattern, int64_t count, int64_t vocab, Rng& rng) {
  Tensor t = Tensor::empty({count}, DType::I32);
  int32_t* p = t.data<int32_t>();
  for (int64_t i = 0; i < count; ++i) {
    switch (pattern) {
      case IdPattern::Same: p[i] = static_cast<int32_t>(vocab - 1); break;
      case IdPattern::Distinct: p[i] = static_cast<int32_t>(i); break;
      case IdPattern::Random: p[i] = static_cast<int32_t>(rng.below(vocab)); break;
    }
  }
  if (pattern == IdPattern::Distinct)
    for (int64_t i = count - 1; i > 0; --i) std::swap(p[i], p[rng.below(i + 1)]);
  if (pattern == IdPattern::Random) {
    p[0] = static_cast<int32_t>(vocab - 1);
    if (count > 2) p[1] = p[count - 1] = 0;
  }
  return t;
}

// The backward against the CPU reference on tokens that repeat from never to at every
// position (runs shorter and longer than the 8 loads a thread keeps in flight), ids from 0
// to past 2^21, counts that are multiples of nothing, rows of 8 to 4096 columns. dtable
// starts random: rows no token hits keep their values exactly, and a second run on the
// same inputs gives the same bits.
TEST(GpuEmbedding, BackwardGroupsTokensDeterministically) {
  Rng rng(seed_for_current_test());
  struct Case {
    IdPattern pattern;
    int64_t count, vocab, hidden;
  };
  for (Case c : {Case{IdPattern::Same, 3001, 50, 8}, Case{IdPattern::Same, 1037, 9, 4096},
                 Case{IdPattern::Distinct, 1000, 1000, 8}, Case{IdPattern::Distinct, 777, 777, 4096},
                 Case{IdPattern::Random, 8191, 300, 8}, Case{IdPattern::Random, 4099, 3001, 4096},
                 Case{IdPattern::Random, 2053, 128256, 64}, Case{IdPattern::Random, 513, (1 << 21) + 5, 8}}) {
    Tensor ids = pattern_ids(c.pattern, c.count, c.vocab, rng);
    Tensor dout = random_bf16_values({c.count, c.hidden}, rng), d0 = random_f32({c.vocab, c.hidden}, rng);
    Tensor dtable = d0.clone();
    embedding_backward(dtable, dout, ids);

    Tensor idsg = ids.to(Device::CUDA), doutg = to_gpu(dout, DType::BF16);
    Tensor first = d0.to(Device::CUDA), second = d0.to(Device::CUDA);
    embedding_backward(first, doutg, idsg);
    embedding_backward(second, doutg, idsg);
    Tensor got = to_cpu_f32(first), again = to_cpu_f32(second);
    const std::string where = fmt::format("pattern {} count {} vocab {} hidden {}", static_cast<int>(c.pattern),
                                          c.count, c.vocab, c.hidden);
    EXPECT_LT(relative_l2(got, dtable), 1e-6) << where;
    EXPECT_EQ(std::memcmp(got.raw(), again.raw(), got.nbytes()), 0) << "two runs differ: " << where;

    std::vector<bool> hit(static_cast<size_t>(c.vocab), false);
    for (int64_t n = 0; n < c.count; ++n) hit[ids.data<int32_t>()[n]] = true;
    int64_t changed = 0;
    for (int64_t v = 0; v < c.vocab; ++v)
      if (!hit[v]) changed += std::memcmp(got.data<float>() + v * c.hidden, d0.data<float>() + v * c.hidden,
                                          sizeof(float) * c.hidden) != 0;
    EXPECT_EQ(changed, 0) << "rows without a token changed: " << where;
  }
}

// Row lengths for both CUDA kernels (kernels/cuda/cross_entropy.cu). The streaming kernel:
// 3, 1003 and 50257 (not multiples of 8: its scalar path) and 2000000 (too long for a
// cluster). The cluster kernel: 1000 and 32000 (one CTA), 50304 (2), 128256 and 151936 (4),
// 256000 (8) and 700000 (8 CTAs holding more than a third of an SM each).
constexpr std::pair<int64_t, int64_t> kCrossEntropyShapes[] = {
    {1, 3},        {33, 1003},    {57, 1000},   {9, 32000},  {7, 50257},  {11, 50304},
    {300, 128256}, {5, 128256},   {6, 151936},  {3, 256000}, {2, 700000}, {2, 2000000}};

// Random targets, but the first rows take the first and last class and the two classes
// either side of the quarter point (where slices of a 4-CTA cluster meet at 128256 and
// 151936), and the middle row is ignored.
Tensor edge_targets(int64_t rows, int64_t vocab, Rng& rng) {
  Tensor targets = random_ids(rows, vocab, rng);
  int32_t* t = targets.data<int32_t>();
  int64_t n = 0;
  for (int64_t probe : {int64_t{0}, vocab - 1, vocab / 4 - 1, vocab / 4}) {
    if (n == rows / 2) ++n;
    if (n < rows && probe >= 0) t[n++] = static_cast<int32_t>(probe);
  }
  t[rows / 2] = kIgnoreIndex;
  return targets;
}

TEST(GpuCrossEntropy, LossAndGradientMatchCpuInPlace) {
  Rng rng(seed_for_current_test());
  for (auto [rows, vocab] : kCrossEntropyShapes) {
    Tensor logits = random_bf16_values({rows, vocab}, rng, 3.0);
    Tensor targets = edge_targets(rows, vocab, rng);
    Tensor losses = Tensor::empty({rows}), dlogits = Tensor::empty({rows, vocab});
    cross_entropy_forward_backward(losses, dlogits, logits, targets, kIgnoreIndex, 1.0f / rows);
    Tensor lg = to_gpu(logits, DType::BF16), lossg = poisoned_gpu({rows}, DType::F32);
    cross_entropy_forward_backward(lossg, lg, lg, targets.to(Device::CUDA), kIgnoreIndex, 1.0f / rows);
    EXPECT_LT(relative_l2(to_cpu_f32(lossg), losses), kF32Tolerance) << rows << "x" << vocab;
    EXPECT_LT(relative_l2(to_cpu_f32(lg), dlogits), kBf16Tolerance) << rows << "x" << vocab;
  }
}

TEST(GpuCrossEntropy, SeparateGradientLossOnlyAndUnalignedRows) {
  Rng rng(seed_for_current_test());
  for (auto [rows, vocab] : kCrossEntropyShapes) {
    if (rows * vocab > 10'000'000) continue;  // the in-place test has the largest case
    Tensor logits = random_bf16_values({rows, vocab}, rng, 3.0);
    Tensor targets = edge_targets(rows, vocab, rng);
    Tensor losses = Tensor::empty({rows}), dlogits = Tensor::empty({rows, vocab});
    cross_entropy_forward_backward(losses, dlogits, logits, targets, kIgnoreIndex, 0.25f);
    const Tensor tg = targets.to(Device::CUDA), lg = to_gpu(logits, DType::BF16);

    Tensor dg = poisoned_gpu({rows, vocab}, DType::BF16), lossg = poisoned_gpu({rows}, DType::F32);
    cross_entropy_forward_backward(lossg, dg, lg, tg, kIgnoreIndex, 0.25f);
    EXPECT_LT(relative_l2(to_cpu_f32(lossg), losses), kF32Tolerance) << "separate " << rows << "x" << vocab;
    EXPECT_LT(relative_l2(to_cpu_f32(dg), dlogits), kBf16Tolerance) << "separate " << rows << "x" << vocab;
    EXPECT_EQ(relative_l2(to_cpu_f32(lg), logits), 0.0) << "the logits are left as they were";

    Tensor loss_only = poisoned_gpu({rows}, DType::F32);
    cross_entropy_forward_backward(loss_only, Tensor(), lg, tg, kIgnoreIndex, 0.25f);
    EXPECT_LT(relative_l2(to_cpu_f32(loss_only), losses), kF32Tolerance) << "loss only " << rows << "x" << vocab;

    // Logits 2 bytes past a 16-byte boundary, differentiated in place.
    Tensor storage = poisoned_gpu({rows * vocab + 1}, DType::BF16);
    Tensor shifted = storage.narrow(1, rows * vocab + 1).view({rows, vocab});
    shifted.copy_from(lg);
    Tensor loss_shifted = poisoned_gpu({rows}, DType::F32);
    cross_entropy_forward_backward(loss_shifted, shifted, shifted, tg, kIgnoreIndex, 0.25f);
    EXPECT_LT(relative_l2(to_cpu_f32(loss_shifted), losses), kF32Tolerance) << "unaligned " << rows << "x" << vocab;
    EXPECT_LT(relative_l2(to_cpu_f32(shifted), dlogits), kBf16Tolerance) << "unaligned " << rows << "x" << vocab;
  }
}

TEST(GpuAdamW, MatchesCpuStepByStepWithClipAndBf16Copy) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
    Tensor p = random_f32({n}, rng), m = Tensor::zeros({n}), v = Tensor::zeros({n});
    Tensor pg = p.to(Device::CUDA), mg = m.to(Device::CUDA), vg = v.to(Device::CUDA);
    for (int64_t step = 1; step <= 3; ++step) {
      Tensor g = random_f32({n}, rng);
      AdamWHyper h{1e-3, 0.9, 0.95, 1e-8, 0.1, step, step == 2 ? 0.37f : 1.0f};
      adamw_update(p, g, m, v, h);
      Tensor copy = poisoned_gpu({n}, DType::BF16);
      adamw_update(pg, g.to(Device::CUDA), mg, vg, h, copy);
      EXPECT_LT(relative_l2(to_cpu_f32(copy), p), 4e-3) << "bf16 copy, step " << step;
    }
    EXPECT_LT(relative_l2(to_cpu_f32(pg), p), 1e-6);
    EXPECT_LT(relative_l2(to_cpu_f32(mg), m), 1e-6);
    EXPECT_LT(relative_l2(to_cpu_f32(vg), v), 1e-6);
  }
}

TEST(GpuAdamW, Bf16MomentsTrackFp32Moments) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {int64_t{5}, int64_t{100003}}) {
    Tensor p = random_f32({n}, rng), m = Tensor::zeros({n}), v = Tensor::zeros({n});
    Tensor pg = p.to(Device::CUDA), mg = Tensor::zeros({n}, DType::BF16, Device::CUDA),
           vg = Tensor::zeros({n}, DType::BF16, Device::CUDA);
    for (int64_t step = 1; step <= 5; ++step) {
      Tensor g = random_f32({n}, rng);
      AdamWHyper h{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
      adamw_update(p, g, m, v, h);
      adamw_update(pg, g.to(Device::CUDA), mg, vg, h);
    }
    EXPECT_LT(relative_l2(to_cpu_f32(pg), p), 1e-4);
    EXPECT_LT(relative_l2(to_cpu_f32(mg), m), 8e-3);
    EXPECT_LT(relative_l2(to_cpu_f32(vg), v), 8e-3);
  }
}

TEST(GpuElementwise, SumOfSquaresAndCasts) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3000017}}) {
    Tensor a = random_f32({n}, rng);
    double ref = sum_of_squares(a);
    double got = sum_of_squares(a.to(Device::CUDA));
    EXPECT_NEAR(got, ref, 1e-9 * ref);
    Tensor bf = poisoned_gpu({n}, DType::BF16);
    cast(bf, a.to(Device::CUDA));
    Tensor back = poisoned_gpu({n}, DType::F32);
    cast(back, bf);
    EXPECT_LT(relative_l2(back.to(Device::CPU), a), 4e-3);
  }
}

TEST(GpuElementwise, AccumulateOnAStreamOfItsOwn) {
  Rng rng(seed_for_current_test());
  DeviceStream stream(Device::CUDA);
  for (DType source : {DType::F32, DType::BF16}) {
    for (int64_t n : {int64_t{1}, int64_t{4097}, int64_t{3000017}}) {
      Tensor dst = random_f32({n}, rng), src = random_bf16_values({n}, rng);
      Tensor expected = dst.to(Device::CPU);
      accumulate(expected, src);
      Tensor gpu_dst = dst.to(Device::CUDA);
      accumulate(gpu_dst, to_gpu(src, source), stream.get());
      stream.synchronize();
      EXPECT_EQ(relative_l2(gpu_dst.to(Device::CPU), expected), 0.0) << dtype_name(source) << " " << n;
    }
  }
}

// bf16 into bf16 (context parallelism's partial key/value gradients): the sum in fp32,
// rounded once, as the CPU does it.
TEST(GpuElementwise, AccumulateBf16IntoBf16) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {int64_t{1}, int64_t{4097}, int64_t{3000017}}) {
    Tensor dst = random_bf16_values({n}, rng), src = random_bf16_values({n}, rng);
    Tensor expected = Tensor::empty({n}, DType::BF16), cpu_src = Tensor::empty({n}, DType::BF16);
    cast(expected, dst);
    cast(cpu_src, src);
    accumulate(expected, cpu_src);
    Tensor gpu_dst = to_gpu(dst, DType::BF16);
    accumulate(gpu_dst, to_gpu(src, DType::BF16));
    Tensor want = Tensor::empty({n});
    cast(want, expected);
    EXPECT_EQ(relative_l2(to_cpu_f32(gpu_dst), want), 0.0) << n;
  }
}

}  // namespace
}  // namespace forge::gpu_test
