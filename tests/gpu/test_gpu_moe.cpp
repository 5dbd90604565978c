// A Mixture-of-Experts model's training step on the GPU (bf16 compute, fp32 master weights
// and gradients) against the CPU reference path (fp32) from the same weights and batch,
// with the balancing loss on: the routing (every expert's load in every layer), the loss
// and every parameter's gradient; and the same step under activation checkpointing. The
// kernels themselves are checked one by one in test_gpu_moe_kernels.cpp.
// The router's top-k is a discontinuous choice: a token whose k-th and (k+1)-th scores are
// closer than bf16's rounding could go to different experts on the two paths, and a moved
// token changes every gradient upstream of it. The step's routers are built so that no
// token is near such a tie (NOTE [Routers without near ties] in gpu_testing.h) and the
// loads are compared first; should a token still move, the gradients get looser bounds.
// The layer itself is checked exactly below (LayerMatchesCpu), where both sides route the
// same logits of random routers.
// Megatron's global balancing loss, whose counts run over a step's micro-batches, is checked
// micro-batch by micro-batch over two steps (GlobalBalancingLossOverMicroBatchesMatchesCpu).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "gpu_testing.h"
#include "moe_step_testing.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/moe.h"
#include "../cpu/moe_testing.h"

namespace forge::gpu_test {
namespace {

TEST(GpuMoe, TrainingStepMatchesCpu) { expect_training_step_matches_cpu(small_moe(), 23); }

// Megatron's sequence-wise balancing loss over the micro-batch's two rows and the router
// z-loss, through the whole step.
// Token dropping (NOTE [MoE capacity]) through the whole step: dropped by weight, then by
// position with every expert padded to its capacity (no offsets copied to the host).
TEST(GpuMoe, TrainingStepWithTokenDroppingMatchesCpu) {
  ModelConfig c = small_moe();
  c.moe_capacity_factor = 1.25;
  expect_training_step_matches_cpu(c, 23);
  c.moe_token_drop_policy = "position";
  c.moe_pad_to_capacity = true;
  expect_training_step_matches_cpu(c, 23);
}

TEST(GpuMoe, TrainingStepWithMegatronLossesMatchesCpu) {
  ModelConfig c = small_moe();
  c.router_aux_loss_type = "sequence";
  c.router_z_loss_coef = 0.01;
  expect_training_step_matches_cpu(c, 23);
  c.router_aux_loss_type = "per_layer";
  expect_training_step_matches_cpu(c, 23);
  c.router_aux_loss_type = "global";  // one micro-batch on one rank: its own counts
  expect_training_step_matches_cpu(c, 23);
  // The z-loss with sigmoid routing (its logits' softmax kept beside the scores).
  c.router_aux_loss_coef = 0.0;
  c.router_aux_loss_type = "pooled";
  c.router_score_function = "sigmoid";
  expect_training_step_matches_cpu(c, 23);
}

// One MoE layer's routed experts (tests/cpu/moe_testing.h's composition: router, route,
// permute, experts, combine into the residual, and the whole backward with the balancing
// loss's gradient) on the GPU against the CPU reference on the same bf16 values. Here the
// router reads the same input on both sides, so the logits differ only by fp32 summation
// order, far below any top-k margin of random data: the choices are compared exactly. With
// each balancing loss (pooled, per_layer, sequence over `sequences` rows, global with counts
// of other simulated ranks' tokens besides) and the z-loss
// (z: its coefficient; 0: none), whose values from the device's routing (its column sums,
// its logsumexp) must be the CPU's. With a capacity (NOTE [MoE capacity]) both sides drop the
// same assignments: the kept rows, offsets and counts are compared exactly.
void layer_matches_cpu(const std::string& aux_type, int64_t sequences, float z, const MoeCapacity& capacity = {}) {
  SCOPED_TRACE(fmt::format("{} balancing loss over {} sequences, z-loss {}, capacity factor {} ({}{})", aux_type,
                           sequences, z, capacity.factor, capacity.by_position ? "position" : "probs",
                           capacity.pad ? ", padded" : ""));
  const int64_t tokens = 96, hidden = 64, ffn = 48, experts = 8, k = 2;
  const int64_t rows = capacity.permuted_rows(tokens, k, experts);
  Rng rng(seed_for_current_test());
  testing::MoeLayer m{hidden,
                      ffn,
                      experts,
                      k,
                      true,
                      random_bf16_values({experts, hidden}, rng, 0.3),
                      random_bf16_values({experts, 2 * ffn, hidden}, rng, 0.1),
                      random_bf16_values({experts, hidden, ffn}, rng, 0.1)};
  m.aux = 0.1f;
  m.aux_type = aux_type;
  m.sequences = sequences;
  m.z = z;
  m.capacity = capacity;
  if (aux_type == "global") {  // as if averaged over three ranks' micro-batches: 3 x tokens x k assignments
    m.total_tokens = 3.0 * tokens;
    double sum = 0.0;
    for (int64_t e = 0; e < experts; ++e) sum += m.tokens_per_expert.emplace_back(0.5 + rng.uniform());
    for (double& c : m.tokens_per_expert) c *= m.total_tokens * k / sum;
  }
  const Tensor x = random_bf16_values({tokens, hidden}, rng), dout = random_bf16_values({tokens, hidden}, rng);
  testing::MoeActivations ca;
  const Tensor cpu_out = testing::moe_forward(m, x, ca);
  const testing::MoeGrads cg = testing::moe_backward(m, x, ca, dout);

  auto gpu = [](Shape shape, DType dtype) { return Tensor::empty(std::move(shape), dtype, Device::CUDA); };
  const Tensor gx = to_gpu(x, DType::BF16), router = to_gpu(m.router, DType::BF16);
  const MoeExpertWeights w{to_gpu(m.gate_up, DType::BF16), to_gpu(m.down, DType::BF16)};
  Tensor logits = gpu({tokens, experts}, DType::F32);
  linear_forward(logits, gx, {router});
  const bool dropping = capacity.factor > 0;
  const MoeRoutingBuffers buffers{gpu({tokens, experts}, DType::F32),
                                  gpu({tokens, k}, DType::I32),
                                  gpu({tokens, k}, DType::F32),
                                  gpu({rows}, DType::I32),
                                  gpu({tokens * k}, DType::I32),
                                  gpu(dropping ? Shape{2, experts + 1} : Shape{experts + 1}, DType::I64),
                                  gpu({experts}, DType::F32),
                                  gpu({tokens}, DType::F32),
                                  dropping ? gpu({tokens * k}, DType::I32) : Tensor()};
  const MoeRouting r = moe_route(logits, k, true, buffers, capacity);
  const Tensor ids = r.expert_ids.to(Device::CPU);
  for (int64_t i = 0; i < tokens * k; ++i)
    ASSERT_EQ(ids.data<int32_t>()[i], ca.routing.expert_ids.data<int32_t>()[i]) << "assignment " << i;
  EXPECT_EQ(r.offsets, ca.routing.offsets);
  if (dropping) {
    EXPECT_EQ(host_values<int32_t>(r.row_of), host_values<int32_t>(ca.routing.row_of));
    EXPECT_EQ(host_values<int32_t>(r.source), host_values<int32_t>(ca.routing.source));
    const MoeCounts counts = moe_expert_counts(r), cpu_counts = moe_expert_counts(ca.routing);
    EXPECT_EQ(counts.assigned, cpu_counts.assigned);
    EXPECT_EQ(counts.kept, cpu_counts.kept);
    int64_t kept = 0;
    for (int64_t n : counts.kept) kept += n;
    // Below a factor of 1 some expert must be over its capacity; at 1.25 a balanced random
    // router may drop nothing, which still runs the capacity's (and padding's) paths.
    if (capacity.factor < 1.0) EXPECT_LT(kept, tokens * k) << "the case drops nothing";
  }
  const MoeExpertBuffers a{gpu({rows, hidden}, DType::BF16), gpu({rows, 2 * ffn}, DType::BF16),
                           gpu({rows, ffn}, DType::BF16), gpu({rows, hidden}, DType::BF16)};
  moe_permute(a.permuted, gx, r);
  moe_experts_forward(a, w, r);
  Tensor out = poisoned_gpu({tokens, hidden}, DType::BF16);
  moe_combine(out, a.expert_out, r, &gx);
  EXPECT_LT(relative_l2(to_cpu_f32(out), cpu_out), kBf16Tolerance);

  // The balancing loss from the device's sums, and its gradient as the CPU harness weighs it.
  const int64_t groups = aux_type == "sequence" ? sequences : 1;
  const MoeBalance cpu_balance = testing::moe_layer_balance(m, ca),
                   balance = aux_type == "pooled"   ? moe_balancing_loss({&r})
                             : aux_type == "global" ? moe_switch_balancing_loss(r, m.tokens_per_expert, m.total_tokens)
                                                    : moe_grouped_balancing_loss(r, groups);
  EXPECT_NEAR(balance.loss, cpu_balance.loss, 1e-5 * cpu_balance.loss);
  ASSERT_EQ(balance.prob_gradient.size(), cpu_balance.prob_gradient.size());
  for (size_t i = 0; i < balance.prob_gradient.size(); ++i)
    EXPECT_NEAR(balance.prob_gradient[i], cpu_balance.prob_gradient[i], 1e-12) << i;  // counts: exact
  const double cpu_z = moe_z_loss(ca.routing), gpu_z = moe_z_loss(r);
  EXPECT_NEAR(gpu_z, cpu_z, 1e-5 * cpu_z);
  Tensor aux_gradient = aux_type == "sequence" ? Tensor::empty({groups, experts}) : Tensor::empty({experts});
  for (int64_t i = 0; i < aux_gradient.numel(); ++i)
    aux_gradient.data<float>()[i] = static_cast<float>(balance.prob_gradient[static_cast<size_t>(i)] * m.aux);
  const Tensor aux_gradient_gpu = aux_gradient.to(Device::CUDA);

  // The backward as MoeFeedForward::backward runs it (without the norm).
  Tensor d_expert_out = poisoned_gpu({rows, hidden}, DType::BF16), d_weights = gpu({tokens, k}, DType::F32);
  const Tensor gdout = to_gpu(dout, DType::BF16);
  moe_combine_backward(d_expert_out, d_weights, gdout, a.expert_out, r);
  const MoeExpertWeights g{poisoned_gpu(w.gate_up.shape(), DType::F32), poisoned_gpu(w.down.shape(), DType::F32)};
  Tensor d_permuted = gpu({rows, hidden}, DType::BF16);
  moe_experts_backward(d_permuted, g, true, d_expert_out, a, w, r, gpu({rows, ffn}, DType::BF16),
                       gpu({rows, 2 * ffn}, DType::BF16));
  Tensor dx = poisoned_gpu({tokens, hidden}, DType::BF16);
  moe_permute_backward(dx, d_permuted, r);
  Tensor d_logits = poisoned_gpu({tokens, experts}, DType::F32), d_logits_bf16 = gpu({tokens, experts}, DType::BF16);
  moe_route_backward(d_logits, d_weights, r, &aux_gradient_gpu, z != 0.0f ? 2.0 * z / tokens : 0.0);
  cast(d_logits_bf16, d_logits);
  Tensor g_router = poisoned_gpu({experts, hidden}, DType::F32);
  matmul(g_router, d_logits_bf16, true, gx, false);
  matmul_add(dx, d_logits_bf16, false, router, false, dx);
  Tensor dx_total = to_cpu_f32(dx);  // + the residual's dout, as the harness's dx
  for (int64_t i = 0; i < dx_total.numel(); ++i) dx_total.data<float>()[i] += dout.data<float>()[i];
  EXPECT_LT(relative_l2(dx_total, cg.dx), 2e-2);
  EXPECT_LT(relative_l2(to_cpu_f32(g_router), cg.router), 2e-2);
  EXPECT_LT(relative_l2(to_cpu_f32(g.gate_up), cg.gate_up), 2e-2);
  EXPECT_LT(relative_l2(to_cpu_f32(g.down), cg.down), 2e-2);
}

TEST(GpuMoe, LayerMatchesCpu) { layer_matches_cpu("pooled", 1, 0.0f); }

// Token dropping through the whole layer: both policies, padded or not, a capacity below and
// above the mean load, with the balancing loss (counted before the drop).
TEST(GpuMoe, LayerWithTokenDroppingMatchesCpu) {
  for (const double factor : {0.5, 1.25})
    for (const bool by_position : {false, true})
      for (const bool pad : {false, true})
        layer_matches_cpu("per_layer", 1, 0.0f, MoeCapacity{factor, by_position, pad});
}

// Megatron's per-layer and sequence-wise balancing losses ([groups, experts] probability
// gradients) and the router z-loss (the routing's logsumexp) on the device.
TEST(GpuMoe, LayerWithMegatronLossesMatchesCpu) {
  layer_matches_cpu("per_layer", 1, 0.0f);
  layer_matches_cpu("sequence", 4, 0.0f);
  layer_matches_cpu("sequence", 3, 0.05f);
  layer_matches_cpu("per_layer", 1, 0.2f);
  layer_matches_cpu("global", 1, 0.0f);
  layer_matches_cpu("global", 1, 0.1f, MoeCapacity{0.75, false, true});
}

// Megatron's global balancing loss through the model (NOTE [MoE balancing loss]): three
// micro-batches of a step, each taking the step's counts so far, then a new step whose counts
// start over; on the GPU as on the CPU, micro-batch by micro-batch: the balancing loss
// (training minus evaluation loss, per target) and every router's gradient. The routers are
// built without near ties (NOTE [Routers without near ties]).
TEST(GpuMoe, GlobalBalancingLossOverMicroBatchesMatchesCpu) {
  ModelConfig c = small_moe();
  c.router_aux_loss_type = "global";
  c.router_aux_loss_coef = 0.5;
  const int64_t batch = 2, seq = 64;
  Rng rng(seed_for_current_test());
  FlatParameters cpu_params(c);
  cpu_params.initialize(29);
  separate_router_choices(cpu_params, rng);
  round_to_bf16(cpu_params.flat());  // both paths start from the same values
  FlatParameters gpu_params(c, Device::CUDA, DType::BF16), cpu_grads(c), gpu_grads(c, Device::CUDA, DType::F32);
  gpu_params.assign_from(cpu_params);
  DecoderLM cpu_model(c, batch, seq), gpu_model(c, batch, seq, Device::CUDA, DType::BF16);
  const float scale = 1.0f / (batch * seq);
  std::vector<double> losses;
  for (int step = 0; step < 2; ++step) {
    cpu_model.begin_step();
    gpu_model.begin_step();
    for (int micro = 0; micro < 3; ++micro) {
      SCOPED_TRACE(fmt::format("step {}, micro-batch {}", step, micro));
      const Tensor tokens = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
      const Tensor gpu_tokens = tokens.to(Device::CUDA);
      cpu_grads.discard();
      gpu_grads.discard();
      const LossSum cpu_train = cpu_model.forward_backward(tokens, tokens, cpu_params, cpu_grads, scale);
      const LossSum gpu_train = gpu_model.forward_backward(gpu_tokens, gpu_tokens, gpu_params, gpu_grads, scale);
      const double cpu_aux =
          (cpu_train.sum - cpu_model.forward_loss(tokens, tokens, cpu_params).sum) / cpu_train.tokens;
      const double gpu_aux =
          (gpu_train.sum - gpu_model.forward_loss(gpu_tokens, gpu_tokens, gpu_params).sum) / gpu_train.tokens;
      std::printf("step %d, micro-batch %d: balancing loss %.6f on the CPU, %.6f on the GPU\n", step, micro, cpu_aux,
                  gpu_aux);
      EXPECT_GT(cpu_aux, 0.0);
      EXPECT_NEAR(gpu_aux, cpu_aux, 2e-2 * cpu_aux);
      losses.push_back(cpu_aux);
      // A moved assignment changes the counts the balancing loss weighs every router score by.
      const int64_t moved = assignments_moved(cpu_model.expert_load(), gpu_model.expert_load());
      for (size_t i = 0; i < cpu_grads.specs().size(); ++i)
        if (cpu_grads.specs()[i].name.ends_with("moe.router.weight"))
          EXPECT_LT(relative_l2(to_cpu_f32(gpu_grads.tensors()[i]), cpu_grads.tensors()[i]), moved == 0 ? 5e-2 : 2.5e-1)
              << cpu_grads.specs()[i].name << " (" << moved << " moved)";
    }
  }
  EXPECT_NE(losses[1], losses[4]);  // a step's micro-batches differ
}

// Two micro-batches accumulate into the gradients written fresh by the first (over NaN):
// the sum of two single steps, and an expert no token of the batch chose gets a zero
// gradient, not the NaN that was there.
TEST(GpuMoe, AccumulatesAndZeroesIdleExperts) {
  ModelConfig c = small_moe();
  c.num_experts = 16;  // 64 tokens x top-2 over 16 experts: some stay idle in some layer
  c.router_aux_loss_coef = 0.0;
  const int64_t batch = 1, seq = 16;
  Rng rng(seed_for_current_test());
  FlatParameters params(c, Device::CUDA, DType::BF16);
  {
    FlatParameters cpu(c);
    cpu.initialize(5);
    params.assign_from(cpu);
  }
  Tensor a = random_ids(seq, c.vocab_size, rng).view({batch, seq}).to(Device::CUDA);
  Tensor b = random_ids(seq, c.vocab_size, rng).view({batch, seq}).to(Device::CUDA);
  DecoderLM model(c, batch, seq, Device::CUDA, DType::BF16);
  FlatParameters ga(c, Device::CUDA, DType::F32), gb(c, Device::CUDA, DType::F32), gab(c, Device::CUDA, DType::F32);
  for (FlatParameters* g : {&ga, &gb, &gab}) {  // NaN everywhere, then written fresh (NOTE [Fresh gradient buffers])
    g->flat().copy_from(poisoned_gpu(g->flat().shape(), DType::F32));
    g->discard();
  }
  model.forward_backward(a, a, params, ga, 1.0f / seq);
  const auto load_a = model.expert_load();
  model.forward_backward(b, b, params, gb, 1.0f / seq);
  model.forward_backward(a, a, params, gab, 1.0f / seq);
  model.forward_backward(b, b, params, gab, 1.0f / seq);

  bool some_idle = false;
  for (size_t i = 0; i < ga.specs().size(); ++i) {
    const ParamSpec& spec = ga.specs()[i];
    Tensor sum = to_cpu_f32(ga.tensors()[i]), two = to_cpu_f32(gab.tensors()[i]);
    const Tensor second = to_cpu_f32(gb.tensors()[i]);
    for (int64_t j = 0; j < sum.numel(); ++j) sum.data<float>()[j] += second.data<float>()[j];
    EXPECT_LT(relative_l2(two, sum), 1e-2) << spec.name;
    if (spec.name.ends_with("moe.experts.down")) {  // [E, H, F]: idle experts of micro-batch a have zeros
      const std::vector<int64_t>& load = load_a.at(static_cast<size_t>(spec.layer));
      const Tensor g = to_cpu_f32(ga.tensors()[i]);
      const int64_t per_expert = g.numel() / c.num_experts;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        if (load[static_cast<size_t>(e)] != 0) continue;
        some_idle = true;
        for (int64_t j = 0; j < per_expert; ++j) ASSERT_EQ(g.data<float>()[e * per_expert + j], 0.0f) << spec.name;
      }
    }
  }
  EXPECT_TRUE(some_idle) << "the batch was meant to leave some expert without tokens";
}

}  // namespace
}  // namespace forge::gpu_test
