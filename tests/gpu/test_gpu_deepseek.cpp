// A DeepSeek-shaped model's training step on the GPU (bf16 compute, fp32 master weights and
// gradients) against the CPU reference path (fp32) from the same weights and batch: Multi-head
// Latent Attention (with and without a compressed query, YaRN RoPE, through cuDNN's attention
// with a value head dim of its own), a dense first block, then MoE blocks with shared experts;
// with softmax routing (DeepSeek-V2) and group-limited sigmoid routing with a bias
// (DeepSeek-V3). The loss, the routing and every parameter's gradient, and the same step
// under activation checkpointing. As in test_gpu_moe.cpp the routers are built so that no
// token is near a tie between experts (NOTE [Routers without near ties] in gpu_testing.h);
// should a token still move, the gradients get looser bounds.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"

namespace forge::gpu_test {
namespace {

ModelConfig small_deepseek(bool v3) {
  ModelConfig c;
  c.name = v3 ? "gpu-test-deepseek-v3" : "gpu-test-deepseek-v2";
  c.vocab_size = 1000;
  c.hidden_size = 256;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.ffn_hidden_size = 384;
  c.max_seq_len = 4096;
  c.rope_theta = 10000;
  c.rope_scaling.enabled = true;
  c.rope_scaling.type = "yarn";
  c.rope_scaling.factor = 40;
  c.rope_scaling.original_max_position = 64;
  c.rope_scaling.mscale = c.rope_scaling.mscale_all_dim = 0.707;
  c.init_std = 0.05;
  c.num_experts = 16;
  c.num_experts_per_tok = v3 ? 4 : 3;
  c.moe_ffn_hidden_size = 64;
  c.num_shared_experts = 2;
  c.first_dense_layers = 1;
  c.kv_lora_rank = 128;
  c.q_lora_rank = v3 ? 96 : 0;
  c.qk_nope_head_dim = 64;
  c.qk_rope_head_dim = 32;
  c.v_head_dim = 64;
  if (v3) {
    c.router_score_function = "sigmoid";
    c.router_normalize_topk = true;
    c.router_scaling_factor = 2.5;
    c.router_num_groups = 4;
    c.router_topk_groups = 2;
  } else {
    c.router_normalize_topk = false;
    c.router_aux_loss_coef = 0.01;
  }
  return c;
}

void step_matches_cpu(const ModelConfig& c) {
  const int64_t batch = 2, seq = 128;
  Rng rng(seed_for_current_test());

  // Weights exactly representable in bf16, so both paths start from the same values; the
  // routing biases of sigmoid routing drawn distinct and small against the routers' spread,
  // so that they do not put ties back (NOTE [Routers without near ties]).
  FlatParameters cpu_params(c), cpu_grads(c);
  cpu_params.initialize(29);
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
  int64_t moved = 0;
  for (size_t layer = 0; layer < gpu_load.size(); ++layer)
    for (size_t e = 0; e < gpu_load[layer].size(); ++e) moved += std::abs(gpu_load[layer][e] - cpu_load[layer][e]);
  moved /= 2;
  const int64_t assignments = static_cast<int64_t>(gpu_load.size()) * batch * seq * c.num_experts_per_tok;
  std::printf("%s step, GPU against CPU: %ld of %ld assignments routed differently\n", c.name.c_str(),
              static_cast<long>(moved), static_cast<long>(assignments));
  ASSERT_LE(moved * 100, assignments) << "more than 1% of the assignments routed differently: beyond near ties";

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
    const bool routed = name.find(".moe.experts") != std::string::npos || name.find(".moe.router") != std::string::npos;
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

TEST(GpuDeepseek, V2TrainingStepMatchesCpu) { step_matches_cpu(small_deepseek(false)); }
TEST(GpuDeepseek, V3TrainingStepMatchesCpu) { step_matches_cpu(small_deepseek(true)); }

}  // namespace
}  // namespace forge::gpu_test
