// The routed experts' GEMMs in FP8 on the CPU (NOTE [FP8 routed experts] in ops/moe_fp8.h)
// against a straightforward reference: each expert's block of rows and its own weight
// matrices quantized tensorwise on their own (amax, torchao's scale, the saturating cast,
// decoded back), multiplied in double. Routings with an expert that receives no rows and
// one that receives every row; the rows of one expert scaled far above the others', which a
// scale shared between experts would quantize differently. The tolerance is the dense FP8
// linear's (tests/cpu/test_ops_fp8_linear.cpp): fp32 rounding of the op's sums. Frozen
// experts with adapters (NOTE [FP8 frozen routed experts]): the same quantized GEMMs for the
// forward and input gradient, no weight gradient, and the adapters' unquantized low-rank
// share and gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/fp8_scaling.h"
#include "ops/fp8_statistics.h"
#include "ops/lora_experts.h"
#include "ops/moe_fp8.h"
#include "ops/swiglu.h"
#include "fp8_testing.h"
#include "ops_testing.h"

namespace forge {
namespace {

using cpu::Fp8Format;
using cpu::Fp8Role;
using testing::random_tensor;
using testing::fake_quantized;
using testing::relative_error;

constexpr double kTolerance = 1e-5;

// out [m, n] = A B^T with A [m, k] and B [n, k] (transpose_a: A given as [k, m]; likewise b).
std::vector<double> gemm(const std::vector<double>& a, bool transpose_a, const std::vector<double>& b,
                         bool transpose_b, int64_t m, int64_t n, int64_t k) {
  std::vector<double> out(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t p = 0; p < k; ++p)
        s += a[static_cast<size_t>(transpose_a ? p * m + i : i * k + p)] *
             b[static_cast<size_t>(transpose_b ? p * n + j : j * k + p)];
      out[static_cast<size_t>(i * n + j)] = s;
    }
  return out;
}

Tensor matrix(const Tensor& stacked, int64_t e) { return stacked.narrow(e, e + 1).view({stacked.dim(1), stacked.dim(2)}); }

// A routing that holds just what the experts' GEMMs read (ops/moe.h): experts and offsets.
MoeRouting routing_of(const std::vector<int64_t>& rows) {
  MoeRouting r;
  r.experts = static_cast<int64_t>(rows.size());
  r.offsets = {0};
  for (int64_t n : rows) r.offsets.push_back(r.offsets.back() + n);
  return r;
}

struct Case {
  std::vector<int64_t> rows;  // per expert
  Fp8Format grad_format;
};

class OpsMoeFp8 : public ::testing::TestWithParam<Case> {};

TEST_P(OpsMoeFp8, EveryExpertsGemmsAreItsOwnQuantizedOperandsProducts) {
  const Case c = GetParam();
  const MoeRouting r = routing_of(c.rows);
  const int64_t experts = r.experts, hidden = 24, ffn = 20, rows = r.offsets.back();
  Rng rng(static_cast<uint64_t>(rows * 31 + experts));
  Tensor x = random_tensor({rows, hidden}, rng);
  // The first expert with rows gets inputs 100 times larger: scales per expert differ.
  for (int64_t e = 0; e < experts; ++e)
    if (r.rows(e) > 0) {
      const Tensor big = x.narrow(r.offsets[static_cast<size_t>(e)], r.offsets[static_cast<size_t>(e) + 1]);
      for (int64_t i = 0; i < big.numel(); ++i) big.data<float>()[i] *= 100.0f;
      break;
    }
  const MoeExpertWeights w{random_tensor({experts, 2 * ffn, hidden}, rng, 0.05),
                           random_tensor({experts, hidden, ffn}, rng, 0.05)};
  const MoeExpertBuffers a{x, Tensor::empty({rows, 2 * ffn}), Tensor::empty({rows, ffn}),
                           Tensor::empty({rows, hidden})};
  // One statistics block per expert and matrix, as Fp8Projections lays them out.
  Tensor stats = Tensor::empty({2 * experts * cpu::kFp8ProjectionStats});
  fp8_stats_init(stats);
  Fp8Linear gate_up{c.grad_format, nullptr}, down{c.grad_format, nullptr};
  gate_up.stats = stats.data<float>();
  down.stats = stats.data<float>() + experts * cpu::kFp8ProjectionStats;
  const MoeExpertFp8 fp8{&gate_up, &down};
  moe_experts_forward_fp8(a, w, r, fp8);

  const Tensor dy = random_tensor({rows, hidden}, rng, 1e-3);
  const MoeExpertWeights grads{Tensor::empty({experts, 2 * ffn, hidden}), Tensor::empty({experts, hidden, ffn})};
  testing::fill_nan(grads.gate_up);
  testing::fill_nan(grads.down);
  const Tensor d_permuted = Tensor::empty({rows, hidden}), d_swiglu = Tensor::empty({rows, ffn}),
               d_gate_up = Tensor::empty({rows, 2 * ffn});
  moe_experts_backward_fp8(d_permuted, grads, /*overwrite=*/true, dy, a, w, r, d_swiglu, d_gate_up, fp8);

  for (int64_t e = 0; e < experts; ++e) {
    const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1], n = end - b;
    if (n == 0) {  // nothing ran: a zero gradient, no amax seen
      for (const Tensor& g : {matrix(grads.gate_up, e), matrix(grads.down, e)})
        for (int64_t i = 0; i < g.numel(); ++i) EXPECT_EQ(g.data<float>()[i], 0.0f) << "expert " << e;
      for (int role = 0; role < cpu::kFp8Roles; ++role)
        EXPECT_EQ(stats.data<float>()[cpu::fp8_seen_offset(e, static_cast<Fp8Role>(role))], 0.0f);
      continue;
    }
    auto rows_of = [&](const Tensor& t) { return t.narrow(b, end); };
    const std::string at = "expert " + std::to_string(e);
    // Forward: gate/up, then down on the op's own SwiGLU output.
    const std::vector<double> xq = fake_quantized(rows_of(x), Fp8Format::E4M3);
    const std::vector<double> wgu = fake_quantized(matrix(w.gate_up, e), Fp8Format::E4M3);
    const std::vector<double> wd = fake_quantized(matrix(w.down, e), Fp8Format::E4M3);
    EXPECT_LT(relative_error(rows_of(a.gate_up), gemm(xq, false, wgu, false, n, 2 * ffn, hidden)), kTolerance) << at;
    const std::vector<double> sq = fake_quantized(rows_of(a.swiglu), Fp8Format::E4M3);
    EXPECT_LT(relative_error(rows_of(a.expert_out), gemm(sq, false, wd, false, n, hidden, ffn)), kTolerance) << at;
    // Backward through down: dx = dy W, dW = dy^T s.
    const std::vector<double> dyq = fake_quantized(rows_of(dy), c.grad_format);
    EXPECT_LT(relative_error(rows_of(d_swiglu), gemm(dyq, false, wd, true, n, ffn, hidden)), kTolerance) << at;
    EXPECT_LT(relative_error(matrix(grads.down, e), gemm(dyq, true, sq, true, hidden, ffn, n)), kTolerance) << at;
    // Backward through gate/up, from the op's own SwiGLU gradient.
    const std::vector<double> dgq = fake_quantized(rows_of(d_gate_up), c.grad_format);
    EXPECT_LT(relative_error(rows_of(d_permuted), gemm(dgq, false, wgu, true, n, hidden, 2 * ffn)), kTolerance) << at;
    EXPECT_LT(relative_error(matrix(grads.gate_up, e), gemm(dgq, true, xq, true, 2 * ffn, hidden, n)), kTolerance)
        << at;
    // Each expert's block saw its own rows' amax.
    float amax = 0.0f;
    for (int64_t i = 0; i < n * hidden; ++i) amax = std::max(amax, std::fabs(rows_of(x).data<float>()[i]));
    EXPECT_EQ(stats.data<float>()[cpu::fp8_seen_offset(e, Fp8Role::X)], amax) << at;
  }
  // Added to, not written over: every expert's gradient doubles (zero stays zero).
  const Tensor once = grads.down.clone();
  moe_experts_backward_fp8(d_permuted, grads, /*overwrite=*/false, dy, a, w, r, d_swiglu, d_gate_up, fp8);
  std::vector<double> twice = testing::to_double(once);
  for (double& v : twice) v *= 2.0;
  EXPECT_LT(relative_error(grads.down, twice), 1e-6);
}

// Expert e's A_e [r, in] and B_e [out, r] (NOTE [LoRA on routed experts]), in double.
std::vector<double> adapter_a(const LoraExpertAdapter& l, int64_t e) {
  return testing::to_double(l.a.narrow(e * l.rank, (e + 1) * l.rank));
}
std::vector<double> adapter_b(const LoraExpertAdapter& l, int64_t e) {
  return testing::to_double(l.b.narrow(e * l.out(), (e + 1) * l.out()));
}

std::vector<double> scaled(std::vector<double> v, double s) {
  for (double& x : v) x *= s;
  return v;
}

std::vector<double> plus(std::vector<double> a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

// NOTE [FP8 frozen routed experts]: LoRA's frozen experts in FP8 with adapters on both
// stacks. Each expert's outputs are its quantized operands' products plus the adapter's
// unquantized x A_e^T B_e^T scale; its input gradients the quantized dy W_e plus
// scale (dy B_e) A_e; the adapters' gradients scale (dy B_e)^T x and scale dy^T (x A_e^T),
// from the op's own dy (down's from the given one, gate/up's from the op's SwiGLU
// gradient); no weight gradient (none is handed in).
TEST_P(OpsMoeFp8, FrozenExpertsWithAdaptersAreTheQuantizedProductsPlusTheAdapters) {
  const Case c = GetParam();
  const MoeRouting r = routing_of(c.rows);
  const int64_t experts = r.experts, hidden = 24, ffn = 20, rows = r.offsets.back(), rank = 3;
  const float scale = 1.5f;
  Rng rng(static_cast<uint64_t>(rows * 17 + experts));
  const Tensor x = random_tensor({rows, hidden}, rng);
  LoraExpertWorkspace ws{Tensor::zeros({rank * std::max<int64_t>(rows, 1)}),
                         Tensor::zeros({rank * std::max<int64_t>(rows, 1)})};
  auto adapter = [&](int64_t out, int64_t in) {
    return LoraExpertAdapter{random_tensor({experts * rank, in}, rng, 0.3), random_tensor({experts * out, rank}, rng, 0.3),
                             Tensor::zeros({experts * rank, in}), Tensor::zeros({experts * out, rank}), rank, experts,
                             scale, &ws};
  };
  const LoraExpertAdapter gate_up_lora = adapter(2 * ffn, hidden), down_lora = adapter(hidden, ffn);
  const MoeExpertWeights w{random_tensor({experts, 2 * ffn, hidden}, rng, 0.05),
                           random_tensor({experts, hidden, ffn}, rng, 0.05), &gate_up_lora, &down_lora};
  const MoeExpertWeights frozen{Tensor(), Tensor(), &gate_up_lora, &down_lora};  // LoraAdapters' gradient side
  const MoeExpertBuffers a{x, Tensor::empty({rows, 2 * ffn}), Tensor::empty({rows, ffn}),
                           Tensor::empty({rows, hidden})};
  Tensor stats = Tensor::empty({2 * experts * cpu::kFp8ProjectionStats});
  fp8_stats_init(stats);
  Fp8Linear gate_up{c.grad_format, nullptr}, down{c.grad_format, nullptr};
  gate_up.stats = stats.data<float>();
  down.stats = stats.data<float>() + experts * cpu::kFp8ProjectionStats;
  const MoeExpertFp8 fp8{&gate_up, &down};
  moe_experts_forward_fp8(a, w, r, fp8);
  const Tensor dy = random_tensor({rows, hidden}, rng, 1e-3);
  const Tensor d_permuted = Tensor::empty({rows, hidden}), d_swiglu = Tensor::empty({rows, ffn}),
               d_gate_up = Tensor::empty({rows, 2 * ffn});
  moe_experts_backward_fp8(d_permuted, frozen, /*overwrite=*/true, dy, a, w, r, d_swiglu, d_gate_up, fp8);

  for (int64_t e = 0; e < experts; ++e) {
    const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1], n = end - b;
    const std::string at = "expert " + std::to_string(e);
    auto rows_of = [&](const Tensor& t) { return t.narrow(b, end); };
    auto lora_parts = [&](const LoraExpertAdapter& l, const Tensor& x_rows, const Tensor& dy_rows, int64_t out,
                          int64_t in) {
      const std::vector<double> xe = testing::to_double(x_rows), dye = testing::to_double(dy_rows);
      const std::vector<double> u = gemm(xe, false, adapter_a(l, e), false, n, rank, in);      // x A^T
      const std::vector<double> g = gemm(dye, false, adapter_b(l, e), true, n, rank, out);     // dy B
      struct {
        std::vector<double> y, dx, da, db;
      } p{scaled(gemm(u, false, adapter_b(l, e), false, n, out, rank), scale),
          scaled(gemm(g, false, adapter_a(l, e), true, n, in, rank), scale),
          scaled(gemm(g, true, xe, true, rank, in, n), scale), scaled(gemm(dye, true, u, true, out, rank, n), scale)};
      return p;
    };
    auto grad_a = [&](const LoraExpertAdapter& l) { return l.grad_a.narrow(e * rank, (e + 1) * rank); };
    auto grad_b = [&](const LoraExpertAdapter& l) { return l.grad_b.narrow(e * l.out(), (e + 1) * l.out()); };
    if (n == 0) {  // nothing ran: zero adapter gradients, no amax seen
      for (const Tensor& g : {grad_a(gate_up_lora), grad_b(gate_up_lora), grad_a(down_lora), grad_b(down_lora)})
        for (int64_t i = 0; i < g.numel(); ++i) EXPECT_EQ(g.data<float>()[i], 0.0f) << at;
      for (int role = 0; role < cpu::kFp8Roles; ++role)
        EXPECT_EQ(stats.data<float>()[cpu::fp8_seen_offset(e, static_cast<Fp8Role>(role))], 0.0f) << at;
      continue;
    }
    const std::vector<double> wgu = fake_quantized(matrix(w.gate_up, e), Fp8Format::E4M3);
    const std::vector<double> wd = fake_quantized(matrix(w.down, e), Fp8Format::E4M3);
    // Forward.
    const auto gu = lora_parts(gate_up_lora, rows_of(x), rows_of(d_gate_up), 2 * ffn, hidden);
    const std::vector<double> xq = fake_quantized(rows_of(x), Fp8Format::E4M3);
    EXPECT_LT(relative_error(rows_of(a.gate_up), plus(gemm(xq, false, wgu, false, n, 2 * ffn, hidden), gu.y)),
              kTolerance) << at;
    const auto dn = lora_parts(down_lora, rows_of(a.swiglu), rows_of(dy), hidden, ffn);
    const std::vector<double> sq = fake_quantized(rows_of(a.swiglu), Fp8Format::E4M3);
    EXPECT_LT(relative_error(rows_of(a.expert_out), plus(gemm(sq, false, wd, false, n, hidden, ffn), dn.y)), kTolerance)
        << at;
    // Backward through down, then gate/up.
    const std::vector<double> dyq = fake_quantized(rows_of(dy), c.grad_format);
    EXPECT_LT(relative_error(rows_of(d_swiglu), plus(gemm(dyq, false, wd, true, n, ffn, hidden), dn.dx)), kTolerance)
        << at;
    EXPECT_LT(relative_error(grad_a(down_lora), dn.da), kTolerance) << at;
    EXPECT_LT(relative_error(grad_b(down_lora), dn.db), kTolerance) << at;
    const std::vector<double> dgq = fake_quantized(rows_of(d_gate_up), c.grad_format);
    EXPECT_LT(relative_error(rows_of(d_permuted), plus(gemm(dgq, false, wgu, true, n, hidden, 2 * ffn), gu.dx)),
              kTolerance) << at;
    EXPECT_LT(relative_error(grad_a(gate_up_lora), gu.da), kTolerance) << at;
    EXPECT_LT(relative_error(grad_b(gate_up_lora), gu.db), kTolerance) << at;
    // The FP8 GEMMs did run: the expert's block saw its W and dy.
    EXPECT_GT(stats.data<float>()[cpu::fp8_seen_offset(e, Fp8Role::W)], 0.0f) << at;
    EXPECT_GT(stats.data<float>()[cpu::fp8_seen_offset(experts + e, Fp8Role::Dy)], 0.0f) << at;
  }
  // One gradient tensor without the other is refused.
  const MoeExpertWeights half{Tensor::empty({experts, 2 * ffn, hidden}), Tensor(), nullptr, nullptr};
  EXPECT_THROW(
      moe_experts_backward_fp8(d_permuted, half, true, dy, a, w, r, d_swiglu, d_gate_up, fp8), Error);
}

INSTANTIATE_TEST_SUITE_P(Routings, OpsMoeFp8,
                         ::testing::Values(Case{{5, 0, 17, 3}, Fp8Format::E5M2},    // an expert without rows
                                           Case{{0, 0, 40, 0}, Fp8Format::E5M2},    // one expert takes every row
                                           Case{{16, 16, 16, 16}, Fp8Format::E4M3},  // padded to capacity
                                           Case{{1, 2, 0, 33}, Fp8Format::E4M3}));

// The expert stacks' settings are a block per expert; the dense projections' per-call
// records are not carried to an expert.
TEST(OpsMoeFp8Settings, ExpertLinearHasItsOwnBlock) {
  float stats[3 * cpu::kFp8ProjectionStats] = {};
  Fp8ForwardStats forward;
  Fp8Produced produced;
  Fp8Linear stack{Fp8Format::E4M3, nullptr, &forward, stats, true};
  stack.produced = &produced;
  const Fp8Linear e2 = fp8_expert_linear(stack, 2);
  EXPECT_EQ(e2.stats, stats + 2 * cpu::kFp8ProjectionStats);
  EXPECT_EQ(e2.grad_format, Fp8Format::E4M3);
  EXPECT_TRUE(e2.delayed);
  EXPECT_EQ(e2.forward, nullptr);
  EXPECT_EQ(e2.produced, nullptr);
  EXPECT_EQ(e2.weight_cache, nullptr);
}

// NOTE [FP8 expert stack state]: with the stack's per-expert state, expert e's settings take
// its local expert's forward statistics, producer record and weight cache (the model's
// block still the global expert's); the cache only while it is in use; without a local
// index none of it; a local index beyond the state is refused.
TEST(OpsMoeFp8Settings, ExpertLinearTakesItsLocalExpertsState) {
  float stats[8 * cpu::kFp8ProjectionStats] = {};
  float slots[4 * kFp8WorkspaceStats] = {};
  Fp8ExpertStack state;
  init_fp8_expert_stack(state, 4, 6, 5, Device::CPU, /*weight_cache=*/true, nullptr, nullptr);
  EXPECT_EQ(state.experts(), 4);
  EXPECT_TRUE(state.caches.empty());  // the CPU reference keeps no cache
  EXPECT_EQ(state.forward[0].device, nullptr);
  // As Fp8Projections' CUDA state would hold them.
  state.caches.resize(4);
  for (int e = 0; e < 4; ++e) state.forward[static_cast<size_t>(e)].device = slots + e * kFp8WorkspaceStats;
  Fp8Linear stack{Fp8Format::E5M2, nullptr, nullptr, stats};
  stack.experts = &state;
  const Fp8Linear e6 = fp8_expert_linear(stack, /*expert=*/6, /*local=*/2);  // a rank's experts 4..7
  EXPECT_EQ(e6.stats, stats + 6 * cpu::kFp8ProjectionStats);
  EXPECT_EQ(e6.forward, &state.forward[2]);
  EXPECT_EQ(e6.forward->device, slots + 2 * kFp8WorkspaceStats);
  EXPECT_EQ(e6.produced, &state.produced[2]);
  EXPECT_EQ(e6.weight_cache, &state.caches[2]);
  EXPECT_EQ(e6.experts, nullptr);  // an expert is not a stack
  EXPECT_TRUE(e6.varying_tokens);
  state.cache_in_use = false;  // NOTE [FP8 frozen base] before the delayed scales
  EXPECT_EQ(fp8_expert_linear(stack, 6, 2).weight_cache, nullptr);
  EXPECT_EQ(fp8_expert_linear(stack, 6, 2).forward, &state.forward[2]);
  const Fp8Linear bare = fp8_expert_linear(stack, 6);
  EXPECT_EQ(bare.forward, nullptr);
  EXPECT_EQ(bare.produced, nullptr);
  EXPECT_EQ(bare.weight_cache, nullptr);
  EXPECT_THROW(fp8_expert_linear(stack, 6, 4), Error);
}

}  // namespace
}  // namespace forge
