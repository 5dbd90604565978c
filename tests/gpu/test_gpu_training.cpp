// One whole training step of a small model on the GPU (bf16 compute, fp32 master weights
// and gradients) against the CPU reference path (fp32) from the same weights and batch:
// the loss, every parameter's gradient, and the weights after one AdamW step; and the same
// step with activation checkpointing against the GPU step without.
#include <gtest/gtest.h>

#include "gpu_testing.h"
#include "model/parameters.h"
#include "model/decoder_lm.h"
#include "ops/cross_entropy.h"
#include "optim/optimizer.h"

namespace forge::gpu_test {
namespace {

ModelConfig small_model(int64_t window) {
  ModelConfig c;
  c.name = "gpu-test";
  c.vocab_size = 1000;
  c.hidden_size = 256;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 512;
  c.max_seq_len = 256;
  c.sliding_window = window;
  c.rope_theta = 500000;
  c.rope_scaling = RopeScaling{true, 8.0, 1.0, 4.0, 64};
  c.init_std = 0.05;
  return c;
}

TEST(GpuTraining, OneStepMatchesCpu) {
  for (int64_t window : {int64_t{0}, int64_t{24}}) {
    ModelConfig c = small_model(window);
    const int64_t batch = 2, seq = 96;
    Rng rng(seed_for_current_test() + window);

    // Weights exactly representable in bf16, so both paths start from the same values.
    FlatParameters cpu_params(c), cpu_grads(c);
    cpu_params.initialize(17);
    Tensor rounded = Tensor::empty(cpu_params.flat().shape(), DType::BF16);
    cast(rounded, cpu_params.flat());
    cast(cpu_params.flat(), rounded);

    FlatParameters gpu_master(c, Device::CUDA, DType::F32), gpu_compute(c, Device::CUDA, DType::BF16),
        gpu_grads(c, Device::CUDA, DType::F32);
    gpu_master.assign_from(cpu_params);
    gpu_compute.assign_from(cpu_params);

    Tensor tokens = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
    Tensor targets = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
    targets.data<int32_t>()[5] = kIgnoreIndex;
    const float scale = 1.0f / (batch * seq - 1);

    DecoderLM cpu_model(c, batch, seq);
    cpu_grads.zero();
    LossSum cpu_loss = cpu_model.forward_backward(tokens, targets, cpu_params, cpu_grads, scale);

    DecoderLM gpu_model(c, batch, seq, Device::CUDA, DType::BF16);
    gpu_grads.zero();
    LossSum gpu_loss = gpu_model.forward_backward(tokens.to(Device::CUDA), targets.to(Device::CUDA), gpu_compute,
                                                  gpu_grads, scale);
    EXPECT_EQ(gpu_loss.tokens, cpu_loss.tokens);
    EXPECT_NEAR(gpu_loss.mean(), cpu_loss.mean(), 1e-2 * cpu_loss.mean()) << "window " << window;

    for (size_t i = 0; i < cpu_grads.specs().size(); ++i) {
      double err = relative_l2(to_cpu_f32(gpu_grads.tensors()[i]), cpu_grads.tensors()[i]);
      EXPECT_LT(err, 5e-2) << cpu_grads.specs()[i].name << " window " << window;
    }

    // Activation checkpointing recomputes with the same kernels: the same loss, and the
    // same gradients up to the attention backward's non-deterministic dQ accumulation.
    for (ActivationCheckpoint mode : {ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
      DecoderLM checkpointed(c, batch, seq, Device::CUDA, DType::BF16, mode);
      FlatParameters grads(c, Device::CUDA, DType::F32);
      grads.zero();
      LossSum loss = checkpointed.forward_backward(tokens.to(Device::CUDA), targets.to(Device::CUDA), gpu_compute,
                                                   grads, scale);
      EXPECT_EQ(loss.sum, gpu_loss.sum) << activation_checkpoint_name(mode);
      for (size_t i = 0; i < grads.specs().size(); ++i)
        EXPECT_LT(relative_l2(to_cpu_f32(grads.tensors()[i]), to_cpu_f32(gpu_grads.tensors()[i])), 1e-2)
            << grads.specs()[i].name << " " << activation_checkpoint_name(mode);
    }

    OptimizerConfig opt;
    opt.lr = 1e-3;
    std::vector<bool> decay;
    for (const auto& s : cpu_params.specs()) decay.push_back(s.weight_decay);
    AdamW cpu_adam(opt, cpu_params.tensors(), decay), gpu_adam(opt, gpu_master.tensors(), decay);
    cpu_adam.step(cpu_grads.tensors(), opt.lr);
    gpu_adam.step(gpu_grads.tensors(), opt.lr);
    // After one Adam step each weight moves by about lr in the direction of its gradient's
    // sign; compare the updates, not the (much larger) weights.
    Tensor cpu_after = cpu_params.flat(), gpu_after = to_cpu_f32(gpu_master.flat());
    Tensor before = Tensor::empty(cpu_after.shape());
    cast(before, rounded);
    int64_t agree = 0, moved = 0;
    for (int64_t i = 0; i < before.numel(); ++i) {
      float d_cpu = cpu_after.data<float>()[i] - before.data<float>()[i];
      float d_gpu = gpu_after.data<float>()[i] - before.data<float>()[i];
      if (std::abs(d_cpu) > 0.5 * opt.lr) {
        ++moved;
        agree += (d_cpu > 0) == (d_gpu > 0);
      }
    }
    EXPECT_GT(moved, before.numel() / 2);
    EXPECT_GT(static_cast<double>(agree) / moved, 0.97) << "update directions, window " << window;
  }
}

}  // namespace
}  // namespace forge::gpu_test
