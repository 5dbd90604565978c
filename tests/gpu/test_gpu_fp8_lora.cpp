// FP8 under LoRA on the GPU (NOTE [FP8 frozen base] in model/fp8_projections.h): LoRA
// training micro-batches over a frozen bf16 base whose GEMMs run in FP8 against the CPU FP8
// reference on the same bf16 values (tensorwise, and delayed over two steps so that the
// second quantizes with the delayed scales), and the weight cache, filled once for the run,
// giving bitwise the uncached run's losses and adapter gradients (an evaluation first, the
// adapters changing between steps, activation checkpointing's recomputation).
//
// Tolerances as GpuFp8Linear.TrainingMicroBatchMatchesCpu (FP8 casts of bf16 and fp32
// activations landing on neighbouring codes now and then, on top of the bf16 model's own
// differences, 5% in GpuLora's micro-batch): the loss within 1%, the adapters' gradients
// within 10% (relative L2). A wrong FP8 GEMM (transposed, unscaled, a missing adapter
// share) is off by 50% or more.
#include "gpu_testing.h"

#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"

namespace forge {
namespace {

using namespace gpu_test;

LoraConfig lora_config() {
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 16;
  lora.target_modules = "all-linear";
  return lora;
}

// The same bf16 values of A and B on both sides (B random: B = 0 gives A no gradient).
void set_adapters(LoraAdapters& cpu, LoraAdapters& gpu, Rng& rng) {
  for (size_t k = 0; k < cpu.targets().size(); ++k)
    for (size_t p = 0; p < cpu.targets()[k].parts.size(); ++p) {
      const LoraPart& part = cpu.targets()[k].parts[p];
      const int64_t rank = cpu.lora_config().rank;
      const Tensor a = random_bf16_values({rank, cpu.targets()[k].in}, rng, 0.05);
      const Tensor b = random_bf16_values({part.row_end - part.row_begin, rank}, rng, 0.02);
      for (LoraAdapters* side : {&cpu, &gpu}) {
        side->set_part_matrix(k, p, 'a', a);
        side->set_part_matrix(k, p, 'b', b);
      }
    }
  cpu.refresh_compute();
  gpu.refresh_compute();
}

// seq 63: 126 tokens, not a multiple of 16: a frozen base never contracts over the tokens
// (no weight gradient), so FP8 runs (MLPerf's GovReport micro-batch is 8,191 tokens).
class GpuFp8LoraSeq : public ::testing::TestWithParam<int64_t> {};
INSTANTIATE_TEST_SUITE_P(GpuFp8Lora, GpuFp8LoraSeq, ::testing::Values(64, 63));

TEST_P(GpuFp8LoraSeq, TrainingMicroBatchesMatchTheCpu) {
  const ModelConfig config = small_model("fp8-lora-gpu");
  const int64_t batch = 2, seq = GetParam();
  FlatParameters base(config);
  base.initialize(3);
  round_to_bf16(base.flat());  // the GPU's bf16 base, on both sides
  FlatParameters base_gpu(config, Device::CUDA, DType::BF16);
  base_gpu.assign_from(base);
  const Tensor base_before = to_cpu_f32(base_gpu.flat());
  const float scale = 1.0f / static_cast<float>(batch * seq);
  DecoderLM model_cpu(config, batch, seq);
  DecoderLM model_gpu(config, batch, seq, Device::CUDA, DType::BF16, ActivationCheckpoint::Full);

  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    for (const bool head : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise")
                                        << (head ? ", FP8 head, e4m3 gradients" : ", bf16 head, e5m2 gradients"));
      Fp8Settings settings;
      settings.recipe = recipe;
      settings.output_head = head;
      settings.grad_format = head ? Fp8Format::E4M3 : Fp8Format::E5M2;
      settings.frozen = true;
      settings.weight_cache = true;
      Fp8Projections fp8_cpu(config, settings, Device::CPU, batch * seq);
      Fp8Projections fp8_gpu(config, settings, Device::CUDA, batch * seq);
      fp8_cpu.set_base(base);
      fp8_gpu.set_base(base_gpu);
      LoraAdapters cpu(config, lora_config(), Device::CPU, batch * seq);
      LoraAdapters gpu(config, lora_config(), Device::CUDA, batch * seq);
      Rng rng(seed_for_current_test());
      set_adapters(cpu, gpu, rng);
      cpu.set_base(fp8_cpu);
      gpu.set_base(fp8_gpu);
      for (int step = 0; step < 2; ++step) {  // delayed: the second step runs on the delayed scales
        SCOPED_TRACE(::testing::Message() << "step " << step);
        const Tensor tokens = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
        const Tensor targets = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
        cpu.discard();
        gpu.discard();
        const double loss_cpu = model_cpu.forward_backward(tokens, targets, cpu, cpu, scale).mean();
        const double loss_gpu =
            model_gpu.forward_backward(tokens.to(Device::CUDA), targets.to(Device::CUDA), gpu, gpu, scale).mean();
        EXPECT_NEAR(loss_gpu, loss_cpu, 1e-2 * loss_cpu);
        for (size_t i = 0; i < cpu.gradients().size(); ++i)
          EXPECT_LT(relative_l2(to_cpu_f32(gpu.gradients()[i]), cpu.gradients()[i]), 0.1) << cpu.master_names()[i];
        EXPECT_EQ(fp8_gpu.nonfinite_amax(), "");
        fp8_cpu.end_step(true);
        fp8_gpu.end_step(true);
      }
      EXPECT_EQ(fp8_gpu.delayed_state().active, recipe == Fp8Recipe::Delayed);
    }
  }
  EXPECT_EQ(relative_l2(to_cpu_f32(base_gpu.flat()), base_before), 0.0);  // the frozen base is untouched
}

// NOTE [FP8 frozen base]: the cache holds each frozen weight's codes for the whole run (a
// delayed run from the first update on); every loss and adapter gradient is bitwise the
// uncached run's, with an evaluation before the first step (its amaxes discarded) and the
// adapters moving between steps as the optimizer moves them.
TEST(GpuFp8Lora, WeightCacheFilledOnceGivesTheSameBits) {
  const ModelConfig config = small_model("fp8-lora-cache-gpu");
  const int64_t batch = 2, seq = 64;
  FlatParameters base(config);
  base.initialize(5);
  Rng rng(seed_for_current_test());
  const Tensor tokens = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA);
  const Tensor targets = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA);
  const float scale = 1.0f / static_cast<float>(batch * seq);
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    SCOPED_TRACE(recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise");
    std::vector<std::vector<double>> losses(2);
    std::vector<std::vector<std::vector<float>>> grads(2);
    for (const bool cache : {false, true}) {
      FlatParameters weights(config, Device::CUDA, DType::BF16);
      weights.assign_from(base);
      Fp8Settings settings;
      settings.recipe = recipe;
      settings.weight_cache = cache;
      settings.output_head = true;
      settings.frozen = true;
      Fp8Projections fp8(config, settings, Device::CUDA, batch * seq);
      fp8.set_base(weights);
      LoraAdapters adapters(config, lora_config(), Device::CUDA, batch * seq);
      adapters.initialize(9);
      adapters.set_base(fp8);
      DecoderLM model(config, batch, seq, Device::CUDA, DType::BF16, ActivationCheckpoint::Full);
      losses[cache].push_back(model.forward_loss(tokens, targets, adapters).mean());  // an evaluation
      fp8.discard_amaxes();
      for (int step = 0; step < 3; ++step) {
        for (int micro = 0; micro < 2; ++micro) {
          adapters.discard();
          losses[cache].push_back(model.forward_backward(tokens, targets, adapters, adapters, scale).mean());
          grads[cache].push_back(host_values<float>(adapters.gradient_flat()));
        }
        fp8.end_step(true);
        // The optimizer's turn: the adapters move (B from zero), the base does not.
        for (const Tensor& master : adapters.masters()) {
          Tensor values = master.to(Device::CPU);
          for (int64_t i = 0; i < values.numel(); ++i)
            values.data<float>()[i] = values.data<float>()[i] * 0.9f + 0.001f * static_cast<float>((i % 7) - 3);
          master.copy_from(values.to(Device::CUDA));
        }
        adapters.refresh_compute();
      }
    }
    EXPECT_EQ(losses[1], losses[0]);
    ASSERT_EQ(grads[1].size(), grads[0].size());
    for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(grads[1][i] == grads[0][i]) << "micro-batch " << i;
  }
}

}  // namespace
}  // namespace forge
