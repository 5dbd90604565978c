// LoRA on the GPU against the CPU reference (ops/lora.h, model/lora.h): the dropout mask
// is the CPU's, bit for bit; the block mask too; the adapter linear's forward, input
// gradient and adapter gradients match the CPU on the same bf16 values, with and without
// dropout; a LoRA training micro-batch (frozen bf16 base, adapters) gives the CPU path's
// loss and adapter gradients.
#include "gpu_testing.h"

#include "model/decoder_lm.h"
#include "model/lora.h"
#include "ops/linear.h"
#include "ops/lora.h"

namespace forge {
namespace {

using namespace gpu_test;

TEST(GpuLora, DropoutAndBlockMaskAreTheCpusBitForBit) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {1, 255, 100003}) {
    const Tensor in = random_bf16_values({n}, rng), acc = random_bf16_values({n}, rng);
    Tensor out = acc.clone();
    lora_dropout(out, in, 0.3f, 77, true);
    Tensor out_g = to_gpu(acc, DType::BF16);
    lora_dropout(out_g, to_gpu(in, DType::BF16), 0.3f, 77, true);
    const Tensor got = to_cpu_f32(out_g);
    for (int64_t i = 0; i < n; ++i) {
      const bool dropped = out.data<float>()[i] == acc.data<float>()[i];
      // Kept elements: the CPU's fp32 value rounded to bf16; dropped: the accumulator unchanged.
      const float want = dropped ? acc.data<float>()[i] : to_float(to_bf16(out.data<float>()[i]));
      ASSERT_EQ(got.data<float>()[i], want) << n << " element " << i;
    }
  }
  const Tensor b = random_f32({37, 12}, rng);
  const std::vector<LoraPartRows> parts = {{0, 10}, {10, 20}, {25, 37}};
  Tensor bg = b.to(Device::CUDA);
  lora_mask_blocks(b, 4, parts);
  lora_mask_blocks(bg, 4, parts);
  EXPECT_EQ(relative_l2(to_cpu_f32(bg), b), 0.0);
}

struct Adapter {
  Tensor a, b;
  LoraWorkspace workspace;
  LoraAdapter lora;
};

Adapter make_adapter(const Tensor& a, const Tensor& b, int64_t rank, float dropout, std::vector<LoraPartRows> parts,
                     int64_t tokens, Device device) {
  Adapter m;
  const DType dtype = device == Device::CUDA ? DType::BF16 : DType::F32;
  m.a = device == Device::CUDA ? to_gpu(a, dtype) : a;
  m.b = device == Device::CUDA ? to_gpu(b, dtype) : b;
  const int64_t low = a.dim(0);
  m.workspace = {Tensor::zeros({low * tokens}, dtype, device), Tensor::zeros({low * tokens}, dtype, device),
                 Tensor::zeros({tokens * a.dim(1)}, dtype, device)};
  m.lora.a = m.a;
  m.lora.b = m.b;
  m.lora.grad_a = Tensor::zeros(a.shape(), DType::F32, device);
  m.lora.grad_b = Tensor::zeros(b.shape(), DType::F32, device);
  m.lora.rank = rank;
  m.lora.scale = 2.0f;
  m.lora.dropout = dropout;
  m.lora.dropout_seed = 1234;
  m.lora.parts = std::move(parts);
  return m;
}

TEST(GpuLora, AdapterLinearMatchesCpu) {
  Rng rng(seed_for_current_test());
  const int64_t tokens = 300, in = 256, out = 384, rank = 16;
  const std::vector<LoraPartRows> parts = {{0, 128}, {256, 384}};  // q and v of a fused qkv
  for (float dropout : {0.0f, 0.1f}) {
    const Tensor x = random_bf16_values({tokens, in}, rng), w = random_bf16_values({out, in}, rng, 0.05);
    const Tensor a = random_bf16_values({2 * rank, in}, rng, 0.05), dy = random_bf16_values({tokens, out}, rng);
    Tensor b = random_bf16_values({out, 2 * rank}, rng, 0.05);
    lora_mask_blocks(b, rank, parts);
    Adapter cpu = make_adapter(a, b, rank, dropout, parts, tokens, Device::CPU);
    Adapter gpu = make_adapter(a, b, rank, dropout, parts, tokens, Device::CUDA);
    cpu.lora.workspace = &cpu.workspace;
    gpu.lora.workspace = &gpu.workspace;
    const Tensor xg = to_gpu(x, DType::BF16), wg = to_gpu(w, DType::BF16), dyg = to_gpu(dy, DType::BF16);

    Tensor y = Tensor::empty({tokens, out}), yg = poisoned_gpu({tokens, out}, DType::BF16);
    linear_forward(y, x, LinearWeight{w, &cpu.lora});
    linear_forward(yg, xg, LinearWeight{wg, &gpu.lora});
    EXPECT_LT(relative_l2(to_cpu_f32(yg), y), kBf16Tolerance) << "forward, dropout " << dropout;

    Tensor dx = Tensor::empty({tokens, in}), dxg = poisoned_gpu({tokens, in}, DType::BF16);
    linear_backward_input(dx, dy, LinearWeight{w, &cpu.lora});
    linear_backward_input(dxg, dyg, LinearWeight{wg, &gpu.lora});
    EXPECT_LT(relative_l2(to_cpu_f32(dxg), dx), kBf16Tolerance) << "dx, dropout " << dropout;

    linear_backward_weight(LinearWeight{Tensor(), &cpu.lora}, dy, x, true);
    linear_backward_weight(LinearWeight{Tensor(), &gpu.lora}, dyg, xg, true);
    EXPECT_LT(relative_l2(to_cpu_f32(gpu.lora.grad_a), cpu.lora.grad_a), kBf16Tolerance) << "da, dropout " << dropout;
    EXPECT_LT(relative_l2(to_cpu_f32(gpu.lora.grad_b), cpu.lora.grad_b), kBf16Tolerance) << "db, dropout " << dropout;
  }
}

TEST(GpuLora, TrainingMicroBatchMatchesCpu) {
  const ModelConfig config = small_model("lora-gpu");
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 16;
  lora.target_modules = "all-linear";
  const int64_t batch = 2, seq = 64;

  FlatParameters base(config);
  base.initialize(3);
  round_to_bf16(base.flat());  // the GPU's bf16 base, on both sides
  FlatParameters base_gpu(config, Device::CUDA, DType::BF16);
  base_gpu.assign_from(base);

  LoraAdapters cpu(config, lora, Device::CPU, batch * seq), gpu(config, lora, Device::CUDA, batch * seq);
  cpu.initialize(9);
  gpu.initialize(9);
  Rng rng(seed_for_current_test());
  for (size_t k = 0; k < cpu.targets().size(); ++k)  // B = 0 would give A no gradient
    for (size_t p = 0; p < cpu.targets()[k].parts.size(); ++p) {
      const LoraPart& part = cpu.targets()[k].parts[p];
      const Tensor b = random_bf16_values({part.row_end - part.row_begin, lora.rank}, rng, 0.02);
      cpu.set_part_matrix(k, p, 'b', b);
      gpu.set_part_matrix(k, p, 'b', b);
    }
  gpu.refresh_compute();
  cpu.set_base(base);
  gpu.set_base(base_gpu);

  Tensor tokens = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
  Tensor targets = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
  DecoderLM model_cpu(config, batch, seq);
  DecoderLM model_gpu(config, batch, seq, Device::CUDA, DType::BF16, ActivationCheckpoint::Full);
  cpu.discard();
  gpu.discard();
  const float scale = 1.0f / static_cast<float>(batch * seq);
  const double loss_cpu = model_cpu.forward_backward(tokens, targets, cpu, cpu, scale).mean();
  const double loss_gpu =
      model_gpu.forward_backward(tokens.to(Device::CUDA), targets.to(Device::CUDA), gpu, gpu, scale).mean();
  EXPECT_NEAR(loss_gpu, loss_cpu, 1e-2 * loss_cpu);
  for (size_t i = 0; i < cpu.gradients().size(); ++i)
    EXPECT_LT(relative_l2(to_cpu_f32(gpu.gradients()[i]), cpu.gradients()[i]), 5e-2) << cpu.master_names()[i];
}

}  // namespace
}  // namespace forge
