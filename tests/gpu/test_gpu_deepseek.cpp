// A DeepSeek-shaped model's training step on the GPU (bf16 compute, fp32 master weights and
// gradients) against the CPU reference path (fp32) from the same weights and batch: Multi-head
// Latent Attention (with and without a compressed query, YaRN RoPE, through cuDNN's attention
// with a value head dim of its own), a dense first block, then MoE blocks with shared experts;
// with softmax routing (DeepSeek-V2) and group-limited sigmoid routing with a bias
// (DeepSeek-V3), compared as moe_step_testing.h says.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "moe_step_testing.h"

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

TEST(GpuDeepseek, V2TrainingStepMatchesCpu) { expect_training_step_matches_cpu(small_deepseek(false), 29); }
TEST(GpuDeepseek, V3TrainingStepMatchesCpu) { expect_training_step_matches_cpu(small_deepseek(true), 29); }

}  // namespace
}  // namespace forge::gpu_test
