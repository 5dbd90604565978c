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

TEST(GpuDeepseek, V2TrainingStepMatchesCpu) { expect_training_step_matches_cpu(small_deepseek(false), 29); }
TEST(GpuDeepseek, V3TrainingStepMatchesCpu) { expect_training_step_matches_cpu(small_deepseek(true), 29); }

}  // namespace
}  // namespace forge::gpu_test
