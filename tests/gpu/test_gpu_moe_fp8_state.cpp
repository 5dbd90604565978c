// The routed experts' per-expert FP8 state (NOTE [FP8 expert stack state] in ops/moe_fp8.h:
// forward statistics, weight cache, and the grouped casts of NOTE [FP8 grouped expert casts]
// in kernels/cuda/fp8_grouped_cast.cu) against the expert-by-expert path without it, which
// GpuMoeFp8.ExpertGemmsMatchTheCpuReference checks against the CPU: the outputs, input
// gradients, weight gradients and every statistics block must be the same bits. Two
// micro-batches of one step (the second takes every weight from the cache, and under
// `delayed` folds no W amax, the values already there), then a step's end (the clock moves)
// with new weights: the cache must cast again and still match. Tensorwise and delayed
// scales, both gradient formats, ragged rows with empty experts, and a rank's local experts
// (MoeExpertFp8::first_expert) writing into the whole model's statistics. Every buffer the
// ops write starts poisoned; the measured mismatches are printed.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <tuple>
#include <vector>

#include "cli/config.h"
#include "gpu_testing.h"
#include "kernels/cuda/fp8_grouped_cast.h"
#include "model/parameters.h"
#include "model/fp8_projections.h"
#include "ops/fp8_statistics.h"
#include "ops/moe_fp8.h"

namespace forge::gpu_test {
namespace {

MoeRouting routing_of(const std::vector<int64_t>& rows) {
  MoeRouting r;
  r.experts = static_cast<int64_t>(rows.size());
  r.offsets = {0};
  for (int64_t n : rows) r.offsets.push_back(r.offsets.back() + n);
  return r;
}

// Bytes that differ between two tensors of the same shape and dtype (copied to the host).
int64_t differing_bytes(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::CPU), y = b.to(Device::CPU);
  EXPECT_EQ(x.nbytes(), y.nbytes());
  int64_t n = 0;
  for (size_t i = 0; i < std::min(x.nbytes(), y.nbytes()); ++i)
    n += static_cast<const uint8_t*>(x.raw())[i] != static_cast<const uint8_t*>(y.raw())[i];
  return n;
}

enum class Variant { Stateless, StateExpertByExpert, StateGrouped };
const char* name_of(Variant v) {
  return v == Variant::Stateless ? "stateless" : v == Variant::StateGrouped ? "grouped" : "state, expert by expert";
}

struct Outputs {
  std::vector<Tensor> tensors;  // per micro-batch: gate_up, expert_out, d_permuted, d_swiglu, d_gate_up, dW x2
  Tensor stats;
  std::vector<std::vector<uint64_t>> cast_in;  // per stack and local expert: the generation W was cached in
};

struct Inputs {
  int64_t hidden, ffn, local, blocks, first;
  MoeRouting r;
  Tensor x, dy;
  MoeExpertWeights w[2];  // the first step's weights and the next step's
};

Outputs run(const Inputs& in, Variant v, Fp8Format grad_format, bool delayed) {
  const int64_t n = in.r.offsets.back(), hidden = in.hidden, ffn = in.ffn, local = in.local;
  int64_t most = 0;
  for (int64_t e = 0; e < local; ++e) most = std::max(most, (in.r.rows(e) + 15) / 16 * 16);
  const int64_t codes = std::max(most * 2 * ffn, 2 * ffn * hidden);
  Fp8LinearWorkspace ws{poisoned_gpu({codes}, DType::U8), poisoned_gpu({codes}, DType::U8),
                        poisoned_gpu({codes}, DType::U8), poisoned_gpu({kFp8WorkspaceStats}, DType::F32)};
  Outputs out;
  out.stats = Tensor::empty({2 * in.blocks * cpu::kFp8ProjectionStats}, DType::F32, Device::CUDA);
  fp8_stats_init(out.stats);
  Fp8Linear gate_up{grad_format, &ws}, down{grad_format, &ws};
  gate_up.stats = out.stats.data<float>();
  down.stats = out.stats.data<float>() + in.blocks * cpu::kFp8ProjectionStats;
  gate_up.delayed = down.delayed = delayed;
  uint64_t generation = 0;
  Tensor row_codes = poisoned_gpu({cuda::fp8_grouped_codes_bytes(n, std::max(hidden, ffn), local)}, DType::U8);
  Fp8ExpertStack gu_state, down_state;
  if (v != Variant::Stateless) {
    init_fp8_expert_stack(gu_state, local, 2 * ffn, hidden, Device::CUDA, true, &generation, &row_codes);
    init_fp8_expert_stack(down_state, local, hidden, ffn, Device::CUDA, true, &generation, &row_codes);
    gu_state.grouped = down_state.grouped = v == Variant::StateGrouped;
    gate_up.experts = &gu_state;
    down.experts = &down_state;
  }
  MoeExpertFp8 fp8{&gate_up, &down};
  fp8.first_expert = in.first;
  for (int step = 0; step < 2; ++step) {
    const MoeExpertWeights& w = in.w[step];
    for (int micro = 0; micro < 2; ++micro) {
      const MoeExpertBuffers a{in.x, poisoned_gpu({n, 2 * ffn}, DType::BF16), poisoned_gpu({n, ffn}, DType::BF16),
                               poisoned_gpu({n, hidden}, DType::BF16)};
      moe_experts_forward_fp8(a, w, in.r, fp8);
      const MoeExpertWeights grads{poisoned_gpu({local, 2 * ffn, hidden}, DType::F32),
                                   poisoned_gpu({local, hidden, ffn}, DType::F32)};
      const Tensor d_permuted = poisoned_gpu({n, hidden}, DType::BF16), d_swiglu = poisoned_gpu({n, ffn}, DType::BF16),
                   d_gate_up = poisoned_gpu({n, 2 * ffn}, DType::BF16);
      moe_experts_backward_fp8(d_permuted, grads, true, in.dy, a, w, in.r, d_swiglu, d_gate_up, fp8);
      for (const Tensor* t : {&a.gate_up, &a.expert_out, &d_permuted, &d_swiglu, &d_gate_up, &grads.gate_up,
                              &grads.down})
        out.tensors.push_back(t->to(Device::CPU));
    }
    if (v != Variant::Stateless && step == 0)
      for (const Fp8ExpertStack* s : {&gu_state, &down_state}) {
        out.cast_in.emplace_back();
        for (const Fp8WeightCache& c : s->caches) out.cast_in.back().push_back(c.codes_of);
      }
    ++generation;  // the step's end: the optimizer may change every weight
  }
  out.stats = out.stats.to(Device::CPU);
  return out;
}

void expect_same_bits(const Inputs& in, Fp8Format grad_format, bool delayed) {
  const Outputs want = run(in, Variant::Stateless, grad_format, delayed);
  for (const Variant v : {Variant::StateExpertByExpert, Variant::StateGrouped}) {
    SCOPED_TRACE(::testing::Message() << name_of(v) << ", " << fp8_format_name(grad_format)
                                      << (delayed ? ", delayed" : ", tensorwise") << ", first expert " << in.first);
    const Outputs got = run(in, v, grad_format, delayed);
    int64_t tensors = 0, stats = differing_bytes(want.stats, got.stats);
    ASSERT_EQ(want.tensors.size(), got.tensors.size());
    for (size_t i = 0; i < want.tensors.size(); ++i) {
      const int64_t d = differing_bytes(want.tensors[i], got.tensors[i]);
      EXPECT_EQ(d, 0) << "output " << i % 7 << " of micro-batch " << i / 7;
      tensors += d;
    }
    std::printf("moe fp8 %s %s %s first %lld: differing bytes in outputs %lld, statistics %lld\n", name_of(v),
                fp8_format_name(grad_format), delayed ? "delayed" : "tensorwise", static_cast<long long>(in.first),
                static_cast<long long>(tensors), static_cast<long long>(stats));
    EXPECT_EQ(stats, 0);
    // The cache of the first step: cast in generation 0 for every expert with rows, never
    // for one without (its W is folded nowhere, as without the cache).
    for (const std::vector<uint64_t>& stack : got.cast_in)
      for (int64_t e = 0; e < in.local; ++e)
        EXPECT_EQ(stack[static_cast<size_t>(e)], in.r.rows(e) > 0 ? uint64_t{0} : ~uint64_t{0}) << "expert " << e;
  }
}

TEST(GpuMoeFp8State, CacheAndGroupedCastsGiveTheExpertByExpertBits) {
  Rng rng(seed_for_current_test());
  const int64_t hidden = 128, ffn = 96;
  for (const auto& [rows, blocks, first] :
       {std::tuple{std::vector<int64_t>{5, 0, 37, 3, 0, 0, 200, 11}, int64_t{8}, int64_t{0}},
        std::tuple{std::vector<int64_t>{9, 0, 70, 17}, int64_t{8}, int64_t{4}}}) {  // a rank's experts 4..7
    Inputs in{hidden, ffn, static_cast<int64_t>(rows.size()), blocks, first, routing_of(rows), {}, {}, {}};
    const int64_t n = in.r.offsets.back();
    in.x = to_gpu(random_bf16_values({n, hidden}, rng), DType::BF16);
    in.dy = to_gpu(random_bf16_values({n, hidden}, rng, 1e-3), DType::BF16);
    for (MoeExpertWeights& w : in.w)
      w = {to_gpu(random_bf16_values({in.local, 2 * ffn, hidden}, rng, 0.05), DType::BF16),
           to_gpu(random_bf16_values({in.local, hidden, ffn}, rng, 0.05), DType::BF16)};
    for (const Fp8Format grad_format : {Fp8Format::E5M2, Fp8Format::E4M3})
      for (const bool delayed : {false, true}) expect_same_bits(in, grad_format, delayed);
  }
}

// Fp8Projections hands a CUDA MoE model's expert stacks their state: forward statistics and
// a weight cache per local expert, the grouped casts' shared buffer, none for dense matrices.
TEST(GpuMoeFp8State, ProjectionsMakeTheExpertStacksState) {
  ExperimentConfig cfg = load_experiment("", {{"model.name", "debug-tiny-moe"}});
  const ModelConfig& m = cfg.model;
  Fp8Settings settings;
  settings.weight_cache = true;
  Fp8Projections fp8(m, settings, Device::CUDA, 64);
  FlatParameters params(m), grads(m);
  fp8.set_base(params, grads);
  int64_t stacks = 0;
  for (int i = 0; i < m.num_layers; ++i) {
    const BlockWeights& block = fp8.layer(i);
    for (const LinearWeight& p : block.params) {
      if (!p.fp8) continue;
      if (p.weight.ndim() != 3) {
        EXPECT_EQ(p.fp8->experts, nullptr);
        continue;
      }
      ASSERT_NE(p.fp8->experts, nullptr);
      const Fp8ExpertStack& s = *p.fp8->experts;
      EXPECT_EQ(s.experts(), p.weight.dim(0));
      EXPECT_EQ(static_cast<int64_t>(s.caches.size()), p.weight.dim(0));
      EXPECT_EQ(s.caches.front().codes.numel(), p.weight.dim(1) * p.weight.dim(2));
      EXPECT_NE(s.row_codes, nullptr);
      EXPECT_EQ(s.row_codes->numel(), fp8_expert_row_codes(m, settings, 64));
      ++stacks;
    }
  }
  EXPECT_EQ(stacks, 2 * m.num_layers);
}

}  // namespace
}  // namespace forge::gpu_test
