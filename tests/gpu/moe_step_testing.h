// A Mixture-of-Experts model's training step on the GPU (bf16 compute, fp32 master weights
// and gradients) against the CPU reference path (fp32) from the same weights and batch, for
// test_gpu_moe.cpp (Mixtral-style) and test_gpu_deepseek.cpp (DeepSeek-shaped): the routing
// (every expert's load in every MoE block), the loss and every parameter's gradient, and the
// same step under selective and full activation checkpointing, which must give the same loss
// and routing and gradients within 1e-2 (the attention backward's dQ accumulation is not
// deterministic). The routers are built without near ties (NOTE [Routers without near ties]
// in gpu_testing.h), and the routing biases of sigmoid routing drawn small against their
// spread so that they do not put ties back; should a token still move, the gradients get
// looser bounds, since a moved token changes every gradient upstream of it.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"

namespace forge::gpu_test {

inline void expect_training_step_matches_cpu(const ModelConfig& c, uint64_t init_seed) {
  SCOPED_TRACE(c.name + ", " + c.router_aux_loss_type + " balancing loss, z-loss " +
               std::to_string(c.router_z_loss_coef));
  const int64_t batch = 2, seq = 128;
  Rng rng(seed_for_current_test());

  // Weights exactly representable in bf16, so both paths start from the same values.
  FlatParameters cpu_params(c), cpu_grads(c);
  cpu_params.initialize(init_seed);
  separate_router_choices(cpu_params, rng);  // NOTE [Routers without near ties]
  for (size_t i = 0; i < cpu_params.specs().size(); ++i)
    if (cpu_params.specs()[i].name.ends_with("moe.router.bias"))
      for (int64_t e = 0; e < c.num_experts; ++e)
        cpu_params.tensors()[i].data<float>()[e] = static_cast<float>(0.005 * rng.normal());
  Tensor rounded = Tensor::empty(cpu_params.flat().shape(), DType::BF16);
  cast(rounded, cpu_params.flat());
  cast(cpu_params.flat(), rounded);
  FlatParameters gpu_compute(c, Device::CUDA, DType::BF16), gpu_grads(c, Device::CUDA, DType::F32);
  gpu_compute.assign_from(cpu_params);

  Tensor tokens = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
  Tensor targets = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
  targets.data<int32_t>()[7] = kIgnoreIndex;
  const float scale = 1.0f / (batch * seq - 1);

  DecoderLM cpu_model(c, batch, seq);
  cpu_grads.zero();
  const LossSum cpu_loss = cpu_model.forward_backward(tokens, targets, cpu_params, cpu_grads, scale);

  DecoderLM gpu_model(c, batch, seq, Device::CUDA, DType::BF16);
  gpu_grads.zero();
  const Tensor gpu_tokens = tokens.to(Device::CUDA), gpu_targets = targets.to(Device::CUDA);
  const LossSum gpu_loss = gpu_model.forward_backward(gpu_tokens, gpu_targets, gpu_compute, gpu_grads, scale);

  const auto cpu_load = cpu_model.expert_load(), gpu_load = gpu_model.expert_load();
  ASSERT_EQ(gpu_load.size(), static_cast<size_t>(c.num_layers - c.first_dense_layers));
  ASSERT_EQ(gpu_load.size(), cpu_load.size());
  const int64_t moved = assignments_moved(cpu_load, gpu_load);
  const int64_t assignments = static_cast<int64_t>(gpu_load.size()) * batch * seq * c.num_experts_per_tok;
  std::printf("%s step, GPU against CPU: %ld of %ld assignments routed differently\n", c.name.c_str(),
              static_cast<long>(moved), static_cast<long>(assignments));
  ASSERT_LE(moved * 100, assignments) << "more than 1% of the assignments routed differently: beyond near ties";
  int64_t busiest = 0;
  for (const std::vector<int64_t>& block : gpu_load)
    for (int64_t n : block) busiest = std::max(busiest, n);
  EXPECT_GT(busiest, batch * seq * c.num_experts_per_tok / c.num_experts) << "some expert above the mean load";

  EXPECT_EQ(gpu_loss.tokens, cpu_loss.tokens);
  EXPECT_NEAR(gpu_loss.mean(), cpu_loss.mean(), 1e-2 * cpu_loss.mean());
  for (size_t i = 0; i < cpu_grads.specs().size(); ++i) {
    const std::string& name = cpu_grads.specs()[i].name;
    if (name.ends_with("moe.router.bias")) {  // no gradient, on either path
      EXPECT_EQ(sum_of_squares(gpu_grads.tensors()[i]), 0.0) << name;
      continue;
    }
    const double err = relative_l2(to_cpu_f32(gpu_grads.tensors()[i]), cpu_grads.tensors()[i]);
    std::printf("  %-36s %.2e\n", name.c_str(), err);
    // With token dropping a moved assignment can also change which others its expert keeps,
    // without changing the expert's kept count (the loads compared above): every gradient then
    // gets the routed parameters' bound.
    const bool routed = name.find(".moe.experts") != std::string::npos || name.find(".moe.router") != std::string::npos ||
                        c.moe_capacity_factor > 0.0;
    EXPECT_LT(err, moved == 0 ? 5e-2 : routed ? 2.5e-1 : 1e-1) << name << " (" << moved << " moved)";
  }

  for (ActivationCheckpoint mode : {ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
    DecoderLM checkpointed(c, batch, seq, Device::CUDA, DType::BF16, mode);
    FlatParameters grads(c, Device::CUDA, DType::F32);
    grads.zero();
    const LossSum loss = checkpointed.forward_backward(gpu_tokens, gpu_targets, gpu_compute, grads, scale);
    EXPECT_EQ(loss.sum, gpu_loss.sum) << activation_checkpoint_name(mode);
    EXPECT_EQ(checkpointed.expert_load(), gpu_load) << activation_checkpoint_name(mode);
    for (size_t i = 0; i < grads.specs().size(); ++i) {
      if (grads.specs()[i].name.ends_with("moe.router.bias")) continue;
      EXPECT_LT(relative_l2(to_cpu_f32(grads.tensors()[i]), to_cpu_f32(gpu_grads.tensors()[i])), 1e-2)
          << grads.specs()[i].name << " " << activation_checkpoint_name(mode);
    }
  }
}

}  // namespace forge::gpu_test
