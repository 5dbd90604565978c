// The MoE CUDA kernels (kernels/cuda/moe.h) against their CPU references on fresh random
// data with poisoned outputs (gpu_testing.h):
//  - routing: softmax top-k and DeepSeek-V3's group-limited sigmoid top-k against
//    kernels/cpu/moe.h (probabilities, weights and the softmax's logsumexp within fp32
//    rounding, expert ids exactly:
//    the logits are spread enough that a tie closer than fp32 rounding does not occur, and
//    a differing id is reported unless it is such a near-tie), and their backwards; experts
//    8 to 1024, k 1 to all experts, groups of 1 to 32 experts, an expert receiving no token,
//    every token routed to one expert; the softmax's backward with no probability
//    gradient, one row for every token, a row per group of tokens, and the z-loss's term;
//  - the sort by expert, exactly (offsets, source, row_of), over the single-chunk and the
//    chunked paths;
//  - the probabilities' column sums against double sums, and bitwise the same twice;
//  - the token kernels against the CPU ops of ops/moe.h on a CPU routing: the permutation
//    and the permute backward's sum bit for bit (the same fp32 additions, then one rounding
//    to bf16), the combine within bf16 rounding (with a residual, in place, without), the
//    combine backward's row gradients bit for bit and its weight gradients within fp32
//    rounding, and bitwise the same twice;
//  - no tokens: nothing launched but the sort's zero offsets and the zero column sums;
//  - bad arguments refused;
//  - every kernel once at DeepSeek-V3's scale (32k tokens, 256 experts in 8 groups keeping
//    4, k 8, hidden 7168), the routing sorted consistently, each kernel's time printed.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "gpu_testing.h"
#include "kernels/cpu/moe.h"
#include "kernels/cuda/moe.h"
#include "ops/moe.h"

namespace forge {
namespace {

using gpu_test::bf16_in;
using gpu_test::bf16_out;
using gpu_test::host_values;
using gpu_test::poisoned_gpu;
using gpu_test::random_bf16_values;
using gpu_test::random_f32;
using gpu_test::relative_l2;
using gpu_test::round_to_bf16;
using gpu_test::seed_for_current_test;
using gpu_test::to_cpu_f32;
using gpu_test::to_gpu;


// How a case's logits single out experts.
enum class Special { None, ExpertWithoutTokens, AllToOneExpert };

const char* special_name(Special s) {
  switch (s) {
    case Special::None: return "random";
    case Special::ExpertWithoutTokens: return "an expert without tokens";
    case Special::AllToOneExpert: return "all tokens to one expert";
  }
  return "?";
}

// Logits of normal(0, 2): probabilities spread far wider than fp32 rounding. An expert
// without tokens gets -30 everywhere (valid while k < experts), the one every token goes to
// +30 (the first choice of every token).
Tensor routing_logits(int64_t tokens, int64_t experts, Special special, Rng& rng) {
  Tensor logits = random_f32({tokens, experts}, rng, 2.0);
  float* l = logits.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (special == Special::ExpertWithoutTokens) l[t * experts + experts / 2] = -30.0f;
    if (special == Special::AllToOneExpert) l[t * experts + experts - 1] = 30.0f;
  }
  return logits;
}

Special special_for(size_t case_index, int64_t k, int64_t experts) {
  const Special s = static_cast<Special>(case_index % 3);
  return s == Special::ExpertWithoutTokens && k == experts ? Special::None : s;
}

// Expert ids equal, except where the CPU's ranking values of the two experts are within
// fp32 rounding of each other (a near-tie the two sides may break differently): reported.
// Returns whether they are all equal.
bool expect_same_choices(const std::vector<int32_t>& gpu, const Tensor& cpu_ids, const std::vector<float>& rank,
                         int64_t tokens, int64_t experts, int64_t k, const std::string& what) {
  const int32_t* cpu = cpu_ids.data<int32_t>();
  bool same = true;
  for (int64_t i = 0; i < tokens * k; ++i) {
    if (gpu[i] == cpu[i]) continue;
    same = false;
    const int64_t t = i / k;
    if (gpu[i] < 0 || gpu[i] >= experts) {
      ADD_FAILURE() << what << ": token " << t << " choice " << i % k << " is expert " << gpu[i];
      continue;
    }
    const float a = rank[t * experts + gpu[i]], b = rank[t * experts + cpu[i]];
    EXPECT_LE(std::fabs(a - b), 1e-5f * std::max(std::fabs(a), std::fabs(b)))
        << what << ": token " << t << " choice " << i % k << ": expert " << gpu[i] << " (" << a << ") on the GPU, "
        << cpu[i] << " (" << b << ") on the CPU, not a near-tie";
  }
  return same;
}

// The routing backwards' check: ||gpu - cpu|| <= 1e-5 ||cpu|| + 1e-9 sqrt(n). Both sides
// compute in double, but a saturated router (every token routed to one expert) makes d_logits
// differences of nearly equal terms, about 1e-12 in size, where the two summation orders
// differ by double rounding, 1e-16 of the gradient (measured: 1.2e-5 relative L2 on 33
// tokens of 8 experts); the floor covers that, and is far below the 1e-7 of the gradient
// that fp32 arithmetic leaves there.
void expect_routing_gradient_close(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  const Tensor a = to_cpu_f32(gpu);
  double diff = 0.0, ref = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data<float>()[i], y = cpu.data<float>()[i];
    ASSERT_TRUE(std::isfinite(x)) << what << ": element " << i << " is " << x;
    diff += (x - y) * (x - y);
    ref += y * y;
  }
  const double bound = 1e-5 * std::sqrt(ref) + 1e-9 * std::sqrt(static_cast<double>(a.numel()));
  EXPECT_LE(std::sqrt(diff), bound) << what << ": ||cpu|| " << std::sqrt(ref);
}

// Largest |a - b| / |b| over the elements (b != 0), infinity for a non-finite a.
double max_relative(const Tensor& a, const Tensor& b) {
  double worst = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data<float>()[i], y = b.data<float>()[i];
    if (!std::isfinite(x)) return INFINITY;
    if (y != 0.0) worst = std::max(worst, std::fabs(x - y) / std::fabs(y));
    else worst = std::max(worst, std::fabs(x) > 0.0 ? 1.0 : 0.0);
  }
  return worst;
}

// Routing values against the CPU's: the GPU sums up to 1024 terms in fp32 where the CPU
// sums in double, and subtracts the row's max in fp32 before expf; a wrong formula, slot or
// order is off by far more.
constexpr double kRoutingTolerance = 1e-5;

struct RouteCase {
  int64_t tokens, experts, k;
};

// The GPU's sort by expert of ids_gpu (the values of the host's `ids`) equals
// cpu::moe_sort_by_expert's exactly: offsets, source and row_of.
void expect_sort_like_cpu(const Tensor& ids, const Tensor& ids_gpu, int64_t tokens, int64_t k, int64_t experts,
                          const std::string& what) {
  const int64_t n = tokens * k;
  std::vector<int64_t> offsets(experts + 1);
  Tensor source = Tensor::empty({n}, DType::I32), row_of = Tensor::empty({n}, DType::I32);
  cpu::moe_sort_by_expert(ids.data<int32_t>(), tokens, k, experts, offsets.data(), source.data<int32_t>(),
                          row_of.data<int32_t>());
  Tensor offsets_gpu = poisoned_gpu({experts + 1}, DType::I64), source_gpu = poisoned_gpu({n}, DType::I32),
         row_of_gpu = poisoned_gpu({n}, DType::I32);
  cuda::moe_sort_by_expert(ids_gpu.data<int32_t>(), tokens, k, experts, offsets_gpu.data<int64_t>(),
                           source_gpu.data<int32_t>(), row_of_gpu.data<int32_t>());
  EXPECT_EQ(host_values<int64_t>(offsets_gpu), offsets) << what;
  EXPECT_EQ(host_values<int32_t>(source_gpu), host_values<int32_t>(source)) << what;
  EXPECT_EQ(host_values<int32_t>(row_of_gpu), host_values<int32_t>(row_of)) << what;
}

TEST(GpuMoeKernels, TopkSoftmaxMatchesCpu) {
  Rng rng(seed_for_current_test());
  const std::vector<RouteCase> cases = {{1, 8, 2},    {7, 8, 1},      {33, 8, 8},   {257, 64, 6},   {1000, 256, 8},
                                        {3, 1024, 8}, {65, 40, 4},    {5, 256, 256}, {2, 1024, 1024}, {129, 60, 2},
                                        {4096, 8, 2}, {2048, 256, 6}};
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const auto [tokens, experts, k] = cases[ci];
    for (const bool normalize : {true, false}) {
      const Special special = special_for(ci + normalize, k, experts);
      const std::string what = fmt::format("{} tokens, {} experts, k {}, normalize {}, {}", tokens, experts, k,
                                           normalize, special_name(special));
      const Tensor logits = routing_logits(tokens, experts, special, rng);
      Tensor probs = Tensor::empty({tokens, experts}), ids = Tensor::empty({tokens, k}, DType::I32),
             weights = Tensor::empty({tokens, k}), lse = Tensor::empty({tokens});
      cpu::moe_topk_softmax(logits.data<float>(), tokens, experts, k, normalize, probs.data<float>(),
                            ids.data<int32_t>(), weights.data<float>(), lse.data<float>());

      const Tensor logits_gpu = to_gpu(logits, DType::F32);
      Tensor probs_gpu = poisoned_gpu({tokens, experts}, DType::F32), ids_gpu = poisoned_gpu({tokens, k}, DType::I32),
             weights_gpu = poisoned_gpu({tokens, k}, DType::F32), lse_gpu = poisoned_gpu({tokens}, DType::F32);
      // Every other case without the logsumexp (null: not written).
      cuda::moe_topk_softmax(logits_gpu.data<float>(), tokens, experts, k, normalize, probs_gpu.data<float>(),
                             ids_gpu.data<int32_t>(), weights_gpu.data<float>(),
                             normalize ? lse_gpu.data<float>() : nullptr);
      if (normalize) {  // the z-loss's logsumexp: the max plus logf of the fp32 sum
        const Tensor lse_back = to_cpu_f32(lse_gpu);
        EXPECT_LT(relative_l2(lse_back, lse), kRoutingTolerance) << what;
        EXPECT_LT(max_relative(lse_back, lse), 2 * kRoutingTolerance) << what;
      }
      const Tensor probs_back = to_cpu_f32(probs_gpu);
      EXPECT_LT(relative_l2(probs_back, probs), kRoutingTolerance) << what;
      EXPECT_LT(max_relative(probs_back, probs), 2 * kRoutingTolerance) << what;
      const std::vector<float> rank(probs.data<float>(), probs.data<float>() + probs.numel());
      const std::vector<int32_t> gpu_ids = host_values<int32_t>(ids_gpu);
      if (!expect_same_choices(gpu_ids, ids, rank, tokens, experts, k, what)) continue;
      EXPECT_LT(relative_l2(to_cpu_f32(weights_gpu), weights), kRoutingTolerance) << what;
      if (special == Special::AllToOneExpert)
        for (int64_t t = 0; t < tokens; ++t) EXPECT_EQ(gpu_ids[t * k], experts - 1) << what;
      if (special == Special::ExpertWithoutTokens)
        for (int32_t id : gpu_ids) EXPECT_NE(id, experts / 2) << what;

      // The GPU's ids sorted by expert on the GPU: the CPU's sort of the same ids.
      expect_sort_like_cpu(ids, ids_gpu, tokens, k, experts, what);
    }
  }
}

TEST(GpuMoeKernels, TopkSoftmaxBackwardMatchesCpu) {
  Rng rng(seed_for_current_test());
  const std::vector<RouteCase> cases = {{1, 8, 2},     {7, 8, 1},    {33, 8, 8},      {257, 64, 6}, {1000, 256, 8},
                                        {3, 1024, 8},  {65, 40, 4},  {5, 256, 256},   {2, 1024, 1024}, {129, 60, 40}};
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const auto [tokens, experts, k] = cases[ci];
    for (const bool normalize : {true, false}) {
      // The added gradients: none; a probability gradient [experts] for every token (a
      // layer's balancing loss); one row per group of tokens ([groups, experts], the
      // sequence-wise loss's; the largest of 4, 3, 2, 1 groups dividing the tokens); that
      // with the z-loss's term.
      for (const int mode : {0, 1, 2, 3}) {
        int64_t groups = 1;
        if (mode >= 2)
          for (const int64_t g : {4, 3, 2, 1})
            if (tokens % g == 0) {
              groups = g;
              break;
            }
        const double z_scale = mode == 3 ? 0.37 : 0.0;
        const std::string what = fmt::format("{} tokens, {} experts, k {}, normalize {}, {}", tokens, experts, k,
                                             normalize,
                                             mode == 0   ? "no probability gradient"
                                             : mode == 1 ? "a probability gradient for every token"
                                                         : fmt::format("a probability gradient per {} groups{}", groups,
                                                                       mode == 3 ? ", the z-loss" : ""));
        // The forward on the CPU gives both sides the same routing.
        const Tensor logits = routing_logits(tokens, experts, special_for(ci, k, experts), rng);
        Tensor probs = Tensor::empty({tokens, experts}), ids = Tensor::empty({tokens, k}, DType::I32),
               weights = Tensor::empty({tokens, k}), lse = Tensor::empty({tokens});
        cpu::moe_topk_softmax(logits.data<float>(), tokens, experts, k, normalize, probs.data<float>(),
                              ids.data<int32_t>(), weights.data<float>(), lse.data<float>());
        const Tensor d_weights = random_f32({tokens, k}, rng);
        const Tensor prob_gradient = random_f32({groups, experts}, rng, 0.5);
        const float* pg = mode == 0 ? nullptr : prob_gradient.data<float>();
        Tensor d_logits = Tensor::empty({tokens, experts});
        cpu::moe_topk_softmax_backward(d_weights.data<float>(), pg, tokens / groups, probs.data<float>(),
                                       ids.data<int32_t>(), weights.data<float>(), tokens, experts, k, normalize,
                                       d_logits.data<float>(), mode == 3 ? lse.data<float>() : nullptr, z_scale);

        const Tensor d_weights_gpu = to_gpu(d_weights, DType::F32);
        const Tensor prob_gradient_gpu = to_gpu(prob_gradient, DType::F32), probs_gpu = to_gpu(probs, DType::F32);
        const Tensor ids_gpu = ids.to(Device::CUDA), weights_gpu = to_gpu(weights, DType::F32);
        const Tensor lse_gpu = to_gpu(lse, DType::F32);
        Tensor d_logits_gpu = poisoned_gpu({tokens, experts}, DType::F32);
        cuda::moe_topk_softmax_backward(d_weights_gpu.data<float>(), mode == 0 ? nullptr : prob_gradient_gpu.data<float>(),
                                        tokens / groups, probs_gpu.data<float>(), ids_gpu.data<int32_t>(),
                                        weights_gpu.data<float>(), tokens, experts, k, normalize,
                                        d_logits_gpu.data<float>(), mode == 3 ? lse_gpu.data<float>() : nullptr,
                                        z_scale);
        expect_routing_gradient_close(d_logits_gpu, d_logits, what);
      }
    }
  }
}

struct SigmoidCase {
  int64_t tokens, experts, k, groups, topk_groups;
};

const std::vector<SigmoidCase> kSigmoidCases = {
    {1, 8, 2, 1, 1},      {7, 8, 8, 1, 1},     {33, 64, 6, 8, 3},   {1000, 256, 8, 8, 4},  // DeepSeek-V3's
    {17, 64, 1, 64, 7},   {9, 1024, 8, 32, 4}, {5, 16, 16, 4, 4},   {31, 60, 4, 5, 2},
    {3, 1024, 8, 1024, 8}, {4, 256, 32, 8, 4}, {2048, 256, 8, 8, 4}, {65, 128, 40, 4, 2}};

TEST(GpuMoeKernels, TopkSigmoidMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (size_t ci = 0; ci < kSigmoidCases.size(); ++ci) {
    const auto [tokens, experts, k, groups, topk_groups] = kSigmoidCases[ci];
    for (const bool normalize : {true, false}) {
      const bool with_bias = (ci + normalize) % 2 == 0;
      const float scaling = normalize ? 2.5f : 1.0f;
      // An expert without tokens only where k leaves experts out of every choice.
      Special special = static_cast<Special>((ci + normalize) % 3);
      if (special == Special::ExpertWithoutTokens && k + experts / groups > topk_groups * (experts / groups))
        special = Special::None;
      const std::string what =
          fmt::format("{} tokens, {} experts, k {}, {} groups keeping {}, normalize {}, bias {}, {}", tokens, experts,
                      k, groups, topk_groups, normalize, with_bias, special_name(special));
      const Tensor logits = routing_logits(tokens, experts, special, rng);
      const Tensor bias = random_f32({experts}, rng, 0.05);
      const float* bias_cpu = with_bias ? bias.data<float>() : nullptr;
      Tensor scores = Tensor::empty({tokens, experts}), ids = Tensor::empty({tokens, k}, DType::I32),
             weights = Tensor::empty({tokens, k}), lse = Tensor::empty({tokens}),
             softmax = Tensor::empty({tokens, experts});
      cpu::moe_topk_sigmoid(logits.data<float>(), bias_cpu, tokens, experts, k, groups, topk_groups, normalize,
                            scaling, scores.data<float>(), ids.data<int32_t>(), weights.data<float>(),
                            lse.data<float>(), softmax.data<float>());

      const Tensor logits_gpu = to_gpu(logits, DType::F32), bias_gpu = to_gpu(bias, DType::F32);
      Tensor scores_gpu = poisoned_gpu({tokens, experts}, DType::F32),
             ids_gpu = poisoned_gpu({tokens, k}, DType::I32), weights_gpu = poisoned_gpu({tokens, k}, DType::F32),
             lse_gpu = poisoned_gpu({tokens}, DType::F32), softmax_gpu = poisoned_gpu({tokens, experts}, DType::F32);
      // The z-loss's logsumexp and softmax in the normalized cases only (null: not written).
      cuda::moe_topk_sigmoid(logits_gpu.data<float>(), with_bias ? bias_gpu.data<float>() : nullptr, tokens, experts,
                             k, groups, topk_groups, normalize, scaling, scores_gpu.data<float>(),
                             ids_gpu.data<int32_t>(), weights_gpu.data<float>(),
                             normalize ? lse_gpu.data<float>() : nullptr, normalize ? softmax_gpu.data<float>() : nullptr);
      if (normalize) {
        EXPECT_LT(max_relative(to_cpu_f32(lse_gpu), lse), 2 * kRoutingTolerance) << what;
        EXPECT_LT(relative_l2(to_cpu_f32(softmax_gpu), softmax), kRoutingTolerance) << what;
      }
      const Tensor scores_back = to_cpu_f32(scores_gpu);
      EXPECT_LT(relative_l2(scores_back, scores), 1e-6) << what;  // no sums: a few fp32 ulps
      EXPECT_LT(max_relative(scores_back, scores), 1e-5) << what;
      std::vector<float> choice(static_cast<size_t>(tokens * experts));  // what the CPU ranked
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t e = 0; e < experts; ++e)
          choice[t * experts + e] = scores.data<float>()[t * experts + e] + (bias_cpu ? bias_cpu[e] : 0.0f);
      const std::vector<int32_t> gpu_ids = host_values<int32_t>(ids_gpu);
      if (!expect_same_choices(gpu_ids, ids, choice, tokens, experts, k, what)) continue;
      EXPECT_LT(relative_l2(to_cpu_f32(weights_gpu), weights), kRoutingTolerance) << what;
      if (special == Special::AllToOneExpert && topk_groups == groups && !with_bias)  // its score rounds to 1
        for (int64_t t = 0; t < tokens; ++t) EXPECT_EQ(gpu_ids[t * k], experts - 1) << what;
      if (special == Special::ExpertWithoutTokens)
        for (int32_t id : gpu_ids) EXPECT_NE(id, experts / 2) << what;
    }
  }
}

TEST(GpuMoeKernels, TopkSigmoidBackwardMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (size_t ci = 0; ci < kSigmoidCases.size(); ++ci) {
    const auto [tokens, experts, k, groups, topk_groups] = kSigmoidCases[ci];
    for (const bool normalize : {true, false}) {
      const float scaling = normalize ? 2.5f : 1.5f;
      const std::string what = fmt::format("{} tokens, {} experts, k {}, {} groups keeping {}, normalize {}", tokens,
                                           experts, k, groups, topk_groups, normalize);
      const Tensor logits = routing_logits(tokens, experts, Special::None, rng);
      Tensor scores = Tensor::empty({tokens, experts}), ids = Tensor::empty({tokens, k}, DType::I32),
             weights = Tensor::empty({tokens, k}), lse = Tensor::empty({tokens}),
             softmax = Tensor::empty({tokens, experts});
      cpu::moe_topk_sigmoid(logits.data<float>(), nullptr, tokens, experts, k, groups, topk_groups, normalize,
                            scaling, scores.data<float>(), ids.data<int32_t>(), weights.data<float>(),
                            lse.data<float>(), softmax.data<float>());
      // With the z-loss's term in the normalized cases.
      const double z_scale = normalize ? 0.37 : 0.0;
      const float* z_lse = normalize ? lse.data<float>() : nullptr;
      const float* z_softmax = normalize ? softmax.data<float>() : nullptr;
      const Tensor d_weights = random_f32({tokens, k}, rng);
      Tensor d_logits = Tensor::empty({tokens, experts});
      cpu::moe_topk_sigmoid_backward(d_weights.data<float>(), scores.data<float>(), ids.data<int32_t>(), tokens,
                                     experts, k, normalize, scaling, d_logits.data<float>(), z_lse, z_softmax, z_scale);

      const Tensor d_weights_gpu = to_gpu(d_weights, DType::F32), scores_gpu = to_gpu(scores, DType::F32),
                   ids_gpu = ids.to(Device::CUDA), lse_gpu = to_gpu(lse, DType::F32),
                   softmax_gpu = to_gpu(softmax, DType::F32);
      Tensor d_logits_gpu = poisoned_gpu({tokens, experts}, DType::F32);
      cuda::moe_topk_sigmoid_backward(d_weights_gpu.data<float>(), scores_gpu.data<float>(), ids_gpu.data<int32_t>(),
                                      tokens, experts, k, normalize, scaling, d_logits_gpu.data<float>(),
                                      normalize ? lse_gpu.data<float>() : nullptr,
                                      normalize ? softmax_gpu.data<float>() : nullptr, z_scale);
      expect_routing_gradient_close(d_logits_gpu, d_logits, what);
    }
  }
}

// DeepSeek-V2's softmax routing, group-limited (groups ranked by their best probability) and
// scaled: the forward's probabilities, choices and weights, and the backward through the
// scaling, against the CPU, over the sigmoid cases' group shapes.
TEST(GpuMoeKernels, TopkSoftmaxGroupLimitedAndScaledMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (size_t ci = 0; ci < kSigmoidCases.size(); ++ci) {
    const auto [tokens, experts, k, groups, topk_groups] = kSigmoidCases[ci];
    for (const bool normalize : {true, false}) {
      const float scaling = normalize ? 2.5f : 16.0f;
      const std::string what = fmt::format("{} tokens, {} experts, k {}, {} groups keeping {}, normalize {}, x {}",
                                           tokens, experts, k, groups, topk_groups, normalize, scaling);
      const Tensor logits = routing_logits(tokens, experts, Special::None, rng);
      Tensor probs = Tensor::empty({tokens, experts}), ids = Tensor::empty({tokens, k}, DType::I32),
             weights = Tensor::empty({tokens, k});
      cpu::moe_topk_softmax(logits.data<float>(), tokens, experts, k, normalize, probs.data<float>(),
                            ids.data<int32_t>(), weights.data<float>(), nullptr, groups, topk_groups, scaling);
      const Tensor logits_gpu = to_gpu(logits, DType::F32);
      Tensor probs_gpu = poisoned_gpu({tokens, experts}, DType::F32), ids_gpu = poisoned_gpu({tokens, k}, DType::I32),
             weights_gpu = poisoned_gpu({tokens, k}, DType::F32);
      cuda::moe_topk_softmax(logits_gpu.data<float>(), tokens, experts, k, normalize, probs_gpu.data<float>(),
                             ids_gpu.data<int32_t>(), weights_gpu.data<float>(), nullptr, groups, topk_groups, scaling);
      const Tensor probs_back = to_cpu_f32(probs_gpu);
      EXPECT_LT(relative_l2(probs_back, probs), kRoutingTolerance) << what;
      const std::vector<float> rank(probs.data<float>(), probs.data<float>() + probs.numel());
      const std::vector<int32_t> gpu_ids = host_values<int32_t>(ids_gpu);
      if (topk_groups < groups)  // every choice in a kept group: at most topk_groups distinct groups per token
        for (int64_t t = 0; t < tokens; ++t) {
          std::vector<int32_t> chosen_groups;
          for (int64_t j = 0; j < k; ++j) chosen_groups.push_back(gpu_ids[t * k + j] / (experts / groups));
          std::sort(chosen_groups.begin(), chosen_groups.end());
          EXPECT_LE(std::unique(chosen_groups.begin(), chosen_groups.end()) - chosen_groups.begin(), topk_groups)
              << what << ": token " << t;
        }
      if (!expect_same_choices(gpu_ids, ids, rank, tokens, experts, k, what)) continue;
      EXPECT_LT(relative_l2(to_cpu_f32(weights_gpu), weights), kRoutingTolerance) << what;

      const Tensor d_weights = random_f32({tokens, k}, rng);
      Tensor d_logits = Tensor::empty({tokens, experts});
      cpu::moe_topk_softmax_backward(d_weights.data<float>(), nullptr, tokens, probs.data<float>(),
                                     ids.data<int32_t>(), weights.data<float>(), tokens, experts, k, normalize,
                                     d_logits.data<float>(), nullptr, 0.0, scaling);
      const Tensor d_weights_gpu = to_gpu(d_weights, DType::F32), probs_in = to_gpu(probs, DType::F32),
                   ids_in = ids.to(Device::CUDA), weights_in = to_gpu(weights, DType::F32);
      Tensor d_logits_gpu = poisoned_gpu({tokens, experts}, DType::F32);
      cuda::moe_topk_softmax_backward(d_weights_gpu.data<float>(), nullptr, tokens, probs_in.data<float>(),
                                      ids_in.data<int32_t>(), weights_in.data<float>(), tokens, experts, k, normalize,
                                      d_logits_gpu.data<float>(), nullptr, 0.0, scaling);
      expect_routing_gradient_close(d_logits_gpu, d_logits, what);
    }
  }
}

struct SortCase {
  int64_t tokens, k, experts;
};

// The sort on the GPU equals cpu::moe_sort_by_expert exactly, over the single-chunk path
// (tokens * k up to 1024 or 2 x experts) and the chunked one.
TEST(GpuMoeKernels, SortByExpertMatchesCpuExactly) {
  Rng rng(seed_for_current_test());
  const std::vector<SortCase> cases = {{1, 1, 8},      {1, 8, 256},   {7, 2, 8},       {128, 8, 8},   {1025, 1, 8},
                                       {333, 6, 64},   {65, 1, 1024}, {4097, 8, 256},  {3000, 8, 1024}, {32768, 8, 256},
                                       {4096, 2, 8},   {129, 16, 16}};
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const auto [tokens, k, experts] = cases[ci];
    for (const Special special : {Special::None, Special::ExpertWithoutTokens, Special::AllToOneExpert}) {
      const std::string what =
          fmt::format("{} tokens, k {}, {} experts, {}", tokens, k, experts, special_name(special));
      const int64_t n = tokens * k;
      Tensor ids = Tensor::empty({tokens, k}, DType::I32);
      for (int64_t a = 0; a < n; ++a) {
        int32_t id = static_cast<int32_t>(rng.below(experts));
        if (special == Special::ExpertWithoutTokens && id == experts / 2) id = static_cast<int32_t>((id + 1) % experts);
        if (special == Special::AllToOneExpert) id = static_cast<int32_t>(experts - 1);
        ids.data<int32_t>()[a] = id;
      }
      expect_sort_like_cpu(ids, ids.to(Device::CUDA), tokens, k, experts, what);
    }
  }
}

TEST(GpuMoeKernels, ProbColumnSumsMatchDoubleAndRepeatBitwise) {
  Rng rng(seed_for_current_test());
  const std::vector<std::pair<int64_t, int64_t>> cases = {{1, 8},      {7, 64},    {1000, 256}, {32768, 256},
                                                          {333, 1024}, {5, 60},    {130, 8},    {4097, 13}};
  for (const auto& [tokens, experts] : cases) {
    const std::string what = fmt::format("{} tokens, {} experts", tokens, experts);
    Tensor probs = Tensor::empty({tokens, experts});
    for (int64_t i = 0; i < probs.numel(); ++i) probs.data<float>()[i] = static_cast<float>(rng.uniform());
    Tensor sums = Tensor::empty({experts});
    for (int64_t e = 0; e < experts; ++e) {
      double s = 0.0;
      for (int64_t t = 0; t < tokens; ++t) s += probs.data<float>()[t * experts + e];
      sums.data<float>()[e] = static_cast<float>(s);
    }
    const Tensor probs_gpu = to_gpu(probs, DType::F32);
    Tensor first = poisoned_gpu({experts}, DType::F32), second = poisoned_gpu({experts}, DType::F32);
    cuda::moe_prob_column_sums(probs_gpu.data<float>(), tokens, experts, first.data<float>());
    cuda::moe_prob_column_sums(probs_gpu.data<float>(), tokens, experts, second.data<float>());
    EXPECT_LT(max_relative(to_cpu_f32(first), sums), 1e-5) << what;
    EXPECT_EQ(host_values<uint32_t>(first), host_values<uint32_t>(second)) << what;
  }
}

struct TokenCase {
  int64_t tokens, experts, k, hidden;
};

const std::vector<TokenCase> kTokenCases = {{1, 8, 2, 64},      {7, 8, 8, 8},       {33, 64, 6, 2048},
                                            {257, 256, 8, 1024}, {64, 16, 1, 8192},  {129, 8, 2, 7168},
                                            {3, 16, 16, 64},    {501, 64, 8, 2048}};

// A CPU routing (ops/moe.h's moe_route) of random logits, and its index tensors on the GPU.
struct Routed {
  MoeRouting cpu;
  Tensor source, row_of, weights;  // on the GPU
};

Routed route(const TokenCase& c, Special special, Rng& rng) {
  Routed r;
  r.cpu = moe_route(routing_logits(c.tokens, c.experts, special, rng), c.k, /*normalize=*/true);
  r.source = r.cpu.source.to(Device::CUDA);
  r.row_of = r.cpu.row_of.to(Device::CUDA);
  r.weights = r.cpu.weights.to(Device::CUDA);
  return r;
}

std::string describe(const TokenCase& c, Special special) {
  return fmt::format("{} tokens, {} experts, k {}, hidden {}, {}", c.tokens, c.experts, c.k, c.hidden,
                     special_name(special));
}

TEST(GpuMoeKernels, PermuteAndBackwardMatchCpuBitwise) {
  Rng rng(seed_for_current_test());
  for (size_t ci = 0; ci < kTokenCases.size(); ++ci) {
    const TokenCase c = kTokenCases[ci];
    const Special special = special_for(ci, c.k, c.experts);
    const std::string what = describe(c, special);
    const Routed r = route(c, special, rng);
    const int64_t rows = c.tokens * c.k;

    const Tensor x = random_bf16_values({c.tokens, c.hidden}, rng);
    Tensor permuted = Tensor::empty({rows, c.hidden});
    moe_permute(permuted, x, r.cpu);
    const Tensor x_gpu = to_gpu(x, DType::BF16);
    Tensor permuted_gpu = poisoned_gpu({rows, c.hidden}, DType::BF16);
    cuda::moe_permute(bf16_out(permuted_gpu), bf16_in(x_gpu), r.source.data<int32_t>(), rows, c.k, c.hidden);
    EXPECT_EQ(relative_l2(to_cpu_f32(permuted_gpu), permuted), 0.0) << what;

    const Tensor d_permuted = random_bf16_values({rows, c.hidden}, rng);
    Tensor dx = Tensor::empty({c.tokens, c.hidden});
    moe_permute_backward(dx, d_permuted, r.cpu);
    round_to_bf16(dx);  // the GPU adds the same fp32 values in the same order, then rounds once
    const Tensor d_permuted_gpu = to_gpu(d_permuted, DType::BF16);
    Tensor dx_gpu = poisoned_gpu({c.tokens, c.hidden}, DType::BF16);
    cuda::moe_permute_backward(bf16_out(dx_gpu), bf16_in(d_permuted_gpu), r.row_of.data<int32_t>(), c.tokens, c.k,
                               c.hidden);
    EXPECT_EQ(relative_l2(to_cpu_f32(dx_gpu), dx), 0.0) << what;
  }
}

TEST(GpuMoeKernels, CombineMatchesCpuWithAndWithoutResidual) {
  Rng rng(seed_for_current_test());
  for (size_t ci = 0; ci < kTokenCases.size(); ++ci) {
    const TokenCase c = kTokenCases[ci];
    const Special special = special_for(ci + 1, c.k, c.experts);
    const std::string what = describe(c, special);
    const Routed r = route(c, special, rng);
    const int64_t rows = c.tokens * c.k;
    const Tensor expert_out = random_bf16_values({rows, c.hidden}, rng);
    const Tensor residual = random_bf16_values({c.tokens, c.hidden}, rng);
    Tensor with = Tensor::empty({c.tokens, c.hidden}), without = Tensor::empty({c.tokens, c.hidden});
    moe_combine(with, expert_out, r.cpu, &residual);
    moe_combine(without, expert_out, r.cpu, nullptr);

    const Tensor expert_out_gpu = to_gpu(expert_out, DType::BF16), residual_gpu = to_gpu(residual, DType::BF16);
    // The sums are fp32 (fmaf) against the CPU's double, then one rounding to bf16: within
    // bf16's half-ulp, 2^-9 relative.
    constexpr double kRounding = 2.5e-3;
    Tensor out_gpu = poisoned_gpu({c.tokens, c.hidden}, DType::BF16);
    cuda::moe_combine(bf16_out(out_gpu), bf16_in(expert_out_gpu), r.row_of.data<int32_t>(), r.weights.data<float>(),
                      bf16_in(residual_gpu), c.tokens, c.k, c.hidden);
    EXPECT_LT(relative_l2(to_cpu_f32(out_gpu), with), kRounding) << what << ", residual";
    const Tensor first = out_gpu.clone();

    Tensor in_place = to_gpu(residual, DType::BF16);  // residual and out one buffer
    cuda::moe_combine(bf16_out(in_place), bf16_in(expert_out_gpu), r.row_of.data<int32_t>(), r.weights.data<float>(),
                      bf16_in(in_place), c.tokens, c.k, c.hidden);
    EXPECT_EQ(host_values<uint16_t>(in_place), host_values<uint16_t>(first)) << what << ", in place";

    cuda::moe_combine(bf16_out(out_gpu), bf16_in(expert_out_gpu), r.row_of.data<int32_t>(), r.weights.data<float>(),
                      bf16_in(residual_gpu), c.tokens, c.k, c.hidden);
    EXPECT_EQ(host_values<uint16_t>(out_gpu), host_values<uint16_t>(first)) << what << ", twice";

    Tensor without_gpu = poisoned_gpu({c.tokens, c.hidden}, DType::BF16);
    cuda::moe_combine(bf16_out(without_gpu), bf16_in(expert_out_gpu), r.row_of.data<int32_t>(),
                      r.weights.data<float>(), nullptr, c.tokens, c.k, c.hidden);
    EXPECT_LT(relative_l2(to_cpu_f32(without_gpu), without), kRounding) << what << ", no residual";
  }
}

TEST(GpuMoeKernels, CombineBackwardMatchesCpuAndRepeatsBitwise) {
  Rng rng(seed_for_current_test());
  for (size_t ci = 0; ci < kTokenCases.size(); ++ci) {
    const TokenCase c = kTokenCases[ci];
    const Special special = special_for(ci + 2, c.k, c.experts);
    const std::string what = describe(c, special);
    const Routed r = route(c, special, rng);
    const int64_t rows = c.tokens * c.k;
    const Tensor expert_out = random_bf16_values({rows, c.hidden}, rng);
    const Tensor dout = random_bf16_values({c.tokens, c.hidden}, rng);
    Tensor d_expert_out = Tensor::empty({rows, c.hidden}), d_weights = Tensor::empty({c.tokens, c.k});
    moe_combine_backward(d_expert_out, d_weights, dout, expert_out, r.cpu);
    round_to_bf16(d_expert_out);  // one fp32 product on both sides, rounded once on the GPU

    const Tensor expert_out_gpu = to_gpu(expert_out, DType::BF16), dout_gpu = to_gpu(dout, DType::BF16);
    std::vector<uint16_t> first_rows;
    std::vector<uint32_t> first_weights;
    for (int run = 0; run < 2; ++run) {
      Tensor d_expert_out_gpu = poisoned_gpu({rows, c.hidden}, DType::BF16);
      Tensor d_weights_gpu = poisoned_gpu({c.tokens, c.k}, DType::F32);
      cuda::moe_combine_backward(bf16_out(d_expert_out_gpu), d_weights_gpu.data<float>(), bf16_in(dout_gpu),
                                 bf16_in(expert_out_gpu), r.row_of.data<int32_t>(), r.weights.data<float>(), c.tokens,
                                 c.k, c.hidden);
      if (run == 0) {
        EXPECT_EQ(relative_l2(to_cpu_f32(d_expert_out_gpu), d_expert_out), 0.0) << what;
        EXPECT_LT(relative_l2(to_cpu_f32(d_weights_gpu), d_weights), 1e-5) << what;
        first_rows = host_values<uint16_t>(d_expert_out_gpu);
        first_weights = host_values<uint32_t>(d_weights_gpu);
      } else {
        EXPECT_EQ(host_values<uint16_t>(d_expert_out_gpu), first_rows) << what << ", twice";
        EXPECT_EQ(host_values<uint32_t>(d_weights_gpu), first_weights) << what << ", twice";
      }
    }
  }
}

// No tokens: nothing is launched (null pointers are never read) except the sort's offsets,
// all zero, and the column sums, all zero.
TEST(GpuMoeKernels, ZeroTokensLaunchNothing) {
  const int64_t experts = 64, k = 4, hidden = 64;
  cuda::moe_topk_softmax(nullptr, 0, experts, k, true, nullptr, nullptr, nullptr);
  cuda::moe_topk_softmax_backward(nullptr, nullptr, 1, nullptr, nullptr, nullptr, 0, experts, k, true, nullptr);
  cuda::moe_topk_sigmoid(nullptr, nullptr, 0, experts, k, 8, 4, true, 2.5f, nullptr, nullptr, nullptr);
  cuda::moe_topk_sigmoid_backward(nullptr, nullptr, nullptr, 0, experts, k, true, 2.5f, nullptr);
  cuda::moe_permute(nullptr, nullptr, nullptr, 0, k, hidden);
  cuda::moe_permute_backward(nullptr, nullptr, nullptr, 0, k, hidden);
  cuda::moe_combine(nullptr, nullptr, nullptr, nullptr, nullptr, 0, k, hidden);
  cuda::moe_combine_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, k, hidden);
  Tensor offsets = poisoned_gpu({experts + 1}, DType::I64), sums = poisoned_gpu({experts}, DType::F32);
  cuda::moe_sort_by_expert(nullptr, 0, k, experts, offsets.data<int64_t>(), nullptr, nullptr);
  cuda::moe_prob_column_sums(nullptr, 0, experts, sums.data<float>());
  device_synchronize();
  EXPECT_EQ(host_values<int64_t>(offsets), std::vector<int64_t>(experts + 1, 0));
  EXPECT_EQ(host_values<float>(sums), std::vector<float>(experts, 0.0f));
}

TEST(GpuMoeKernels, BadArgumentsRefused) {
  EXPECT_THROW(cuda::moe_topk_softmax(nullptr, 1, 2048, 2, true, nullptr, nullptr, nullptr), Error);  // > 1024
  EXPECT_THROW(cuda::moe_topk_softmax(nullptr, 1, 8, 9, true, nullptr, nullptr, nullptr), Error);     // k > experts
  EXPECT_THROW(cuda::moe_topk_sigmoid(nullptr, nullptr, 1, 64, 2, 6, 2, true, 1.0f, nullptr, nullptr, nullptr),
               Error);  // 6 groups do not divide 64
  EXPECT_THROW(cuda::moe_topk_sigmoid(nullptr, nullptr, 1, 64, 20, 8, 2, true, 1.0f, nullptr, nullptr, nullptr),
               Error);  // k 20 > the 16 experts of 2 groups
  EXPECT_THROW(cuda::moe_permute(nullptr, nullptr, nullptr, 1, 2, 12), Error);  // hidden % 8
  const Tensor buffer = poisoned_gpu({64}, DType::BF16);
  EXPECT_THROW(cuda::moe_combine(bf16_out(buffer) + 1, bf16_in(buffer), nullptr, nullptr, nullptr, 1, 1, 8), Error);
}

// DeepSeek-V3's routing and token movement at 32k tokens of a step: the routing and its
// sort must be consistent (every expert's rows contiguous, row_of the inverse of source) and
// each kernel's mean time over 10 runs is printed, with the bytes it moves for the token
// kernels. Not a benchmark with a threshold, a record of the order of magnitude.
TEST(GpuMoeKernels, RunsAtDeepSeekV3Scale) {
  const int64_t tokens = 32768, experts = 256, k = 8, groups = 8, topk_groups = 4, hidden = 7168, rows = tokens * k;
  Rng rng(seed_for_current_test());
  const Tensor logits = to_gpu(random_f32({tokens, experts}, rng, 2.0), DType::F32);
  const Tensor bias = to_gpu(random_f32({experts}, rng, 0.05), DType::F32);
  const Tensor d_weights = to_gpu(random_f32({tokens, k}, rng), DType::F32);
  const Tensor probs = Tensor::empty({tokens, experts}, DType::F32, Device::CUDA);
  const Tensor ids = Tensor::empty({tokens, k}, DType::I32, Device::CUDA);
  const Tensor weights = Tensor::empty({tokens, k}, DType::F32, Device::CUDA);
  const Tensor d_logits = Tensor::empty({tokens, experts}, DType::F32, Device::CUDA);
  const Tensor offsets = Tensor::empty({experts + 1}, DType::I64, Device::CUDA);
  const Tensor source = Tensor::empty({rows}, DType::I32, Device::CUDA);
  const Tensor row_of = Tensor::empty({rows}, DType::I32, Device::CUDA);
  const Tensor sums = Tensor::empty({experts}, DType::F32, Device::CUDA);
  const Tensor x = Tensor::zeros({tokens, hidden}, DType::BF16, Device::CUDA);
  const Tensor dx = Tensor::zeros({tokens, hidden}, DType::BF16, Device::CUDA);
  const Tensor permuted = Tensor::zeros({rows, hidden}, DType::BF16, Device::CUDA);
  const Tensor d_expert_out = Tensor::zeros({rows, hidden}, DType::BF16, Device::CUDA);
  const Tensor d_weights_out = Tensor::empty({tokens, k}, DType::F32, Device::CUDA);

  auto time_us = [](const std::function<void()>& launch) {
    launch();
    device_synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) launch();
    device_synchronize();
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 10;
  };
  const double softmax = time_us([&] {
    cuda::moe_topk_softmax(logits.data<float>(), tokens, experts, k, true, probs.data<float>(), ids.data<int32_t>(),
                           weights.data<float>());
  });
  const double column_sums =
      time_us([&] { cuda::moe_prob_column_sums(probs.data<float>(), tokens, experts, sums.data<float>()); });
  const double softmax_backward = time_us([&] {  // the column sums stand in for the balancing loss's gradient
    cuda::moe_topk_softmax_backward(d_weights.data<float>(), sums.data<float>(), tokens, probs.data<float>(),
                                    ids.data<int32_t>(), weights.data<float>(), tokens, experts, k, true,
                                    d_logits.data<float>());
  });
  const double sigmoid = time_us([&] {
    cuda::moe_topk_sigmoid(logits.data<float>(), bias.data<float>(), tokens, experts, k, groups, topk_groups, true,
                           2.5f, probs.data<float>(), ids.data<int32_t>(), weights.data<float>());
  });
  const double sigmoid_backward = time_us([&] {
    cuda::moe_topk_sigmoid_backward(d_weights.data<float>(), probs.data<float>(), ids.data<int32_t>(), tokens,
                                    experts, k, true, 2.5f, d_logits.data<float>());
  });
  const double sort = time_us([&] {
    cuda::moe_sort_by_expert(ids.data<int32_t>(), tokens, k, experts, offsets.data<int64_t>(),
                             source.data<int32_t>(), row_of.data<int32_t>());
  });
  const double permute = time_us([&] {
    cuda::moe_permute(bf16_out(permuted), bf16_in(x), source.data<int32_t>(), tokens * k, k, hidden);
  });
  const double permute_backward = time_us([&] {
    cuda::moe_permute_backward(bf16_out(dx), bf16_in(permuted), row_of.data<int32_t>(), tokens, k, hidden);
  });
  const double combine = time_us([&] {
    cuda::moe_combine(bf16_out(dx), bf16_in(permuted), row_of.data<int32_t>(), weights.data<float>(), bf16_in(x),
                      tokens, k, hidden);
  });
  const double combine_backward = time_us([&] {
    cuda::moe_combine_backward(bf16_out(d_expert_out), d_weights_out.data<float>(), bf16_in(x), bf16_in(permuted),
                               row_of.data<int32_t>(), weights.data<float>(), tokens, k, hidden);
  });

  // The sigmoid routing's sort: offsets ascending from 0 to tokens * k, source and row_of
  // inverse permutations, every row of an expert holding an assignment to it in ascending order.
  const std::vector<int64_t> off = host_values<int64_t>(offsets);
  const std::vector<int32_t> src = host_values<int32_t>(source), row = host_values<int32_t>(row_of),
                             id = host_values<int32_t>(ids);
  ASSERT_EQ(off.front(), 0);
  ASSERT_EQ(off.back(), rows);
  for (int64_t e = 0; e < experts; ++e) {
    ASSERT_LE(off[e], off[e + 1]);
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      ASSERT_EQ(id[src[r]], e);
      ASSERT_EQ(row[src[r]], r);
      if (r > off[e]) ASSERT_LT(src[r - 1], src[r]);
    }
  }
  const double gb = static_cast<double>(rows) * hidden * 2 / 1e9;  // one [tokens * k, hidden] bf16 buffer
  // Bytes, in [tokens * k, hidden] buffers: permute writes one and reads an eighth (x);
  // permute backward the reverse; combine reads one and an eighth (the residual) and writes
  // an eighth; combine backward reads one and an eighth (dout) and writes one.
  std::printf("MoE kernels at %lld tokens, %lld experts, k %lld, hidden %lld (mean of 10, us):\n",
              static_cast<long long>(tokens), static_cast<long long>(experts), static_cast<long long>(k),
              static_cast<long long>(hidden));
  std::printf("  softmax top-k %.1f, backward %.1f, column sums %.1f, sigmoid top-k (8 groups keep 4) %.1f, "
              "backward %.1f, sort %.1f\n",
              softmax, softmax_backward, column_sums, sigmoid, sigmoid_backward, sort);
  std::printf("  permute %.0f (%.2f TB/s), permute backward %.0f (%.2f TB/s), combine %.0f (%.2f TB/s), "
              "combine backward %.0f (%.2f TB/s)\n",
              permute, gb * 1.125 / permute * 1e3, permute_backward, gb * 1.125 / permute_backward * 1e3, combine,
              gb * 1.25 / combine * 1e3, combine_backward, gb * 2.125 / combine_backward * 1e3);
}

}  // namespace
}  // namespace forge
