// Token dropping's CUDA kernels (NOTE [MoE capacity] in ops/moe.h) against their CPU
// references, on fresh random data with poisoned outputs (gpu_testing.h):
//  - moe_drop_to_capacity after the GPU's sort: the kept offsets, source and row_of exactly
//    as kernels/cpu/moe.h's, by weight and by position, padded or not, capacities below and
//    above the mean load; cases with an expert that gets no assignment, one overloaded by every
//    token, weights with many exact ties (rounded to sixteenths), and experts with more than
//    256 assignments (several tiles of the ranking loop);
//  - the token kernels with dropped assignments and padding rows, on a CPU routing with a
//    capacity: permute (padding rows zero) and its backward bit for bit, combine within bf16
//    rounding, combine backward's rows bit for bit (moe_zero_padding writing the padding rows'
//    zeros) and its weight gradients within fp32 rounding, 0 for the dropped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

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


enum class Load { Random, ExpertWithoutAssignments, AllOnOneExpert };

const char* load_name(Load l) {
  switch (l) {
    case Load::Random: return "random";
    case Load::ExpertWithoutAssignments: return "an expert without assignments";
    case Load::AllOnOneExpert: return "every token's first choice on one expert";
  }
  return "?";
}

struct DropCase {
  int64_t tokens, k, experts;
};

TEST(GpuMoeCapacity, DropToCapacityMatchesCpuExactly) {
  Rng rng(seed_for_current_test());
  const std::vector<DropCase> cases = {{7, 2, 8},   {100, 2, 8},   {600, 1, 8},     {333, 6, 64},
                                       {1000, 8, 256}, {4096, 2, 8}, {129, 16, 16}};
  for (const DropCase c : cases)
    for (const Load load : {Load::Random, Load::ExpertWithoutAssignments, Load::AllOnOneExpert})
      for (const bool tied : {false, true})
        for (const double factor : {0.25, 1.0, 1.5})
          for (const bool by_position : {false, true})
            for (const bool pad : {false, true}) {
              const int64_t n = c.tokens * c.k, e = c.experts;
              const int64_t capacity = MoeCapacity{factor}.capacity(c.tokens, c.k, e);
              const int64_t rows = pad ? e * capacity : n;
              const std::string what = fmt::format(
                  "{} tokens, k {}, {} experts, {}{}, capacity {} (factor {}), {}{}", c.tokens, c.k, e,
                  load_name(load), tied ? ", tied weights" : "", capacity, factor,
                  by_position ? "position" : "probs", pad ? ", padded" : "");
              Tensor ids = Tensor::empty({n}, DType::I32), weights = Tensor::empty({n});
              for (int64_t a = 0; a < n; ++a) {
                int32_t id = static_cast<int32_t>(rng.below(e));
                if (load == Load::ExpertWithoutAssignments && id == e / 2) id = static_cast<int32_t>((id + 1) % e);
                if (load == Load::AllOnOneExpert && a % c.k == 0) id = static_cast<int32_t>(e - 1);
                ids.data<int32_t>()[a] = id;
                const double w = rng.uniform();
                weights.data<float>()[a] = static_cast<float>(tied ? std::floor(w * 16.0) / 16.0 : w);
              }
              std::vector<int64_t> sorted_offsets(e + 1), kept_offsets(e + 1);
              Tensor sorted = Tensor::empty({n}, DType::I32), row_of = Tensor::empty({n}, DType::I32);
              Tensor source = Tensor::empty({rows}, DType::I32);
              cpu::moe_sort_by_expert(ids.data<int32_t>(), c.tokens, c.k, e, sorted_offsets.data(),
                                      sorted.data<int32_t>(), row_of.data<int32_t>());
              cpu::moe_drop_to_capacity(sorted.data<int32_t>(), sorted_offsets.data(), weights.data<float>(),
                                        c.tokens, c.k, e, capacity, by_position, pad, kept_offsets.data(),
                                        source.data<int32_t>(), row_of.data<int32_t>());

              const Tensor ids_gpu = ids.to(Device::CUDA), weights_gpu = weights.to(Device::CUDA);
              Tensor offsets_gpu = poisoned_gpu({2, e + 1}, DType::I64);
              Tensor sorted_gpu = poisoned_gpu({n}, DType::I32), row_of_gpu = poisoned_gpu({n}, DType::I32);
              Tensor source_gpu = poisoned_gpu({std::max<int64_t>(rows, 1)}, DType::I32);
              int64_t* kept_gpu = offsets_gpu.data<int64_t>();
              cuda::moe_sort_by_expert(ids_gpu.data<int32_t>(), c.tokens, c.k, e, kept_gpu + e + 1,
                                       sorted_gpu.data<int32_t>(), row_of_gpu.data<int32_t>());
              cuda::moe_drop_to_capacity(sorted_gpu.data<int32_t>(), kept_gpu + e + 1, weights_gpu.data<float>(),
                                         c.tokens, c.k, e, capacity, by_position, pad, kept_gpu,
                                         source_gpu.data<int32_t>(), row_of_gpu.data<int32_t>());
              const std::vector<int64_t> both = host_values<int64_t>(offsets_gpu);
              EXPECT_EQ(std::vector<int64_t>(both.begin(), both.begin() + e + 1), kept_offsets) << what;
              EXPECT_EQ(std::vector<int64_t>(both.begin() + e + 1, both.end()), sorted_offsets) << what;
              std::vector<int32_t> gpu_source = host_values<int32_t>(source_gpu);
              gpu_source.resize(static_cast<size_t>(rows));
              EXPECT_EQ(gpu_source, host_values<int32_t>(source)) << what;
              EXPECT_EQ(host_values<int32_t>(row_of_gpu), host_values<int32_t>(row_of)) << what;
            }
}

struct TokenCase {
  int64_t tokens, experts, k, hidden;
  double factor;
};

TEST(GpuMoeCapacity, TokenKernelsWithDropsAndPaddingMatchCpu) {
  Rng rng(seed_for_current_test());
  const std::vector<TokenCase> cases = {{33, 8, 2, 64, 0.5},      {257, 64, 6, 1024, 1.0}, {129, 8, 2, 2048, 1.25},
                                        {64, 16, 1, 512, 0.25},   {501, 64, 8, 256, 3.0}};
  for (const TokenCase c : cases)
    for (const bool by_position : {false, true})
      for (const bool pad : {false, true}) {
        const std::string what = fmt::format("{} tokens, {} experts, k {}, hidden {}, factor {}, {}{}", c.tokens,
                                             c.experts, c.k, c.hidden, c.factor, by_position ? "position" : "probs",
                                             pad ? ", padded" : "");
        Tensor logits = random_f32({c.tokens, c.experts}, rng, 2.0);
        for (int64_t t = 0; t < c.tokens; ++t) logits.data<float>()[t * c.experts] += 3.0f;  // expert 0 overloaded
        const MoeRouting r = moe_route(logits, c.k, true, {}, MoeCapacity{c.factor, by_position, pad});
        const int64_t rows = r.permuted_rows(), used = r.offsets.back();
        const Tensor source = r.source.to(Device::CUDA), row_of = r.row_of.to(Device::CUDA),
                     weights = r.weights.to(Device::CUDA);

        const Tensor x = random_bf16_values({c.tokens, c.hidden}, rng);
        Tensor permuted = Tensor::zeros({rows, c.hidden});
        moe_permute(permuted, x, r);
        const Tensor x_gpu = to_gpu(x, DType::BF16);
        Tensor permuted_gpu = poisoned_gpu({rows, c.hidden}, DType::BF16);
        cuda::moe_permute(bf16_out(permuted_gpu), bf16_in(x_gpu), source.data<int32_t>(), used, c.k, c.hidden);
        EXPECT_EQ(relative_l2(to_cpu_f32(permuted_gpu).narrow(0, used), permuted.narrow(0, used)), 0.0) << what;

        const Tensor d_permuted = random_bf16_values({rows, c.hidden}, rng);
        Tensor dx = Tensor::empty({c.tokens, c.hidden});
        moe_permute_backward(dx, d_permuted, r);
        round_to_bf16(dx);
        const Tensor d_permuted_gpu = to_gpu(d_permuted, DType::BF16);
        Tensor dx_gpu = poisoned_gpu({c.tokens, c.hidden}, DType::BF16);
        cuda::moe_permute_backward(bf16_out(dx_gpu), bf16_in(d_permuted_gpu), row_of.data<int32_t>(), c.tokens, c.k,
                                   c.hidden);
        EXPECT_EQ(relative_l2(to_cpu_f32(dx_gpu), dx), 0.0) << what;

        const Tensor expert_out = random_bf16_values({rows, c.hidden}, rng);
        const Tensor residual = random_bf16_values({c.tokens, c.hidden}, rng);
        Tensor out = Tensor::empty({c.tokens, c.hidden});
        moe_combine(out, expert_out, r, &residual);
        const Tensor expert_out_gpu = to_gpu(expert_out, DType::BF16), residual_gpu = to_gpu(residual, DType::BF16);
        Tensor out_gpu = poisoned_gpu({c.tokens, c.hidden}, DType::BF16);
        cuda::moe_combine(bf16_out(out_gpu), bf16_in(expert_out_gpu), row_of.data<int32_t>(), weights.data<float>(),
                          bf16_in(residual_gpu), c.tokens, c.k, c.hidden);
        EXPECT_LT(relative_l2(to_cpu_f32(out_gpu), out), 2.5e-3) << what;

        const Tensor dout = random_bf16_values({c.tokens, c.hidden}, rng);
        Tensor d_expert_out = Tensor::zeros({rows, c.hidden}), d_weights = Tensor::empty({c.tokens, c.k});
        moe_combine_backward(d_expert_out, d_weights, dout, expert_out, r);
        round_to_bf16(d_expert_out);
        const Tensor dout_gpu = to_gpu(dout, DType::BF16);
        Tensor d_expert_out_gpu = poisoned_gpu({rows, c.hidden}, DType::BF16);
        Tensor d_weights_gpu = poisoned_gpu({c.tokens, c.k}, DType::F32);
        if (pad) cuda::moe_zero_padding(bf16_out(d_expert_out_gpu), source.data<int32_t>(), rows, c.hidden);
        cuda::moe_combine_backward(bf16_out(d_expert_out_gpu), d_weights_gpu.data<float>(), bf16_in(dout_gpu),
                                   bf16_in(expert_out_gpu), row_of.data<int32_t>(), weights.data<float>(), c.tokens,
                                   c.k, c.hidden);
        // Rows of an assignment and padding rows are written; without padding the rows past
        // the kept ones are not (nothing reads them).
        EXPECT_EQ(relative_l2(to_cpu_f32(d_expert_out_gpu).narrow(0, used), d_expert_out.narrow(0, used)), 0.0)
            << what;
        const Tensor d_weights_host = to_cpu_f32(d_weights_gpu);
        EXPECT_LT(relative_l2(d_weights_host, d_weights), 1e-5) << what;
        int64_t dropped = 0;
        for (int64_t a = 0; a < c.tokens * c.k; ++a)
          if (r.row_of.data<int32_t>()[a] < 0) {
            ++dropped;
            EXPECT_EQ(d_weights_host.data<float>()[a], 0.0f) << what << ", assignment " << a;
          }
        if (c.factor < 1.0) EXPECT_GT(dropped, 0) << what;
      }
}

}  // namespace
}  // namespace forge
