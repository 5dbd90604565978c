// QLoRA with FP8 on the GPU (NOTE [FP8 over an NF4 base] in model/nf4_base.cpp): each NF4
// projection dequantized into the bf16 scratch, then cast to E4M3 by the FP8 ops.
//  - Against LoRA with FP8 over a bf16 base holding the same dequantized values (the CPU's
//    fp32 dequantization rounded to bf16, which the GPU's dequantization is bitwise,
//    OpsNf4.Bf16DequantizationRoundsTheFp32Values and GpuQlora): the same W values give the
//    same amaxes, codes and GEMMs, so the losses and adapter gradients must be bitwise equal
//    over two steps (delayed: the second on the delayed scales), with and without
//    activation checkpointing's recomputation. This is what checks that the backward's reuse
//    of W's forward statistics, keyed by the scratch's address that every projection shares
//    (NOTE [FP8 forward statistics]), is right.
//  - Against the CPU reference (QLoRA FP8 over the fp32 dequantized base): the loss within
//    1%, the adapters' gradients within 15% (relative L2): GpuFp8Lora's 10% was exceeded on
//    the H200 by qkv's A at the first step (0.104; the NF4 base's bf16 dequantization and an
//    E4M3 code moving now and then, every other gradient within 0.074).
// The measured differences are printed.
#include "gpu_testing.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "model/nf4_base.h"

namespace forge {
namespace {

using namespace gpu_test;

LoraConfig qlora_config() {
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 16;
  lora.target_modules = "all-linear";
  lora.quantize_base = "nf4";
  return lora;
}

Fp8Settings frozen(Fp8Recipe recipe) {
  Fp8Settings s;
  s.recipe = recipe;
  s.frozen = true;
  s.weight_cache = false;  // as fp8_settings_of under QLoRA
  return s;
}

// The same adapter values on every side (B random: B = 0 gives A no gradient).
void set_adapters(const std::vector<LoraAdapters*>& sides, Rng& rng) {
  LoraAdapters& first = *sides.front();
  for (size_t k = 0; k < first.targets().size(); ++k)
    for (size_t p = 0; p < first.targets()[k].parts.size(); ++p) {
      const LoraPart& part = first.targets()[k].parts[p];
      const int64_t rank = first.lora_config().rank;
      const Tensor a = random_bf16_values({rank, first.targets()[k].in}, rng, 0.05);
      const Tensor b = random_bf16_values({part.row_end - part.row_begin, rank}, rng, 0.02);
      for (LoraAdapters* side : sides) {
        side->set_part_matrix(k, p, 'a', a);
        side->set_part_matrix(k, p, 'b', b);
      }
    }
  for (LoraAdapters* side : sides) side->refresh_compute();
}

TEST(GpuQloraFp8, TrainingEqualsLoraFp8OnTheDequantizedBaseAndTracksTheCpu) {
  const ModelConfig config = small_model("qlora-fp8-gpu");
  const int64_t batch = 2, seq = 64;
  FlatParameters imported(config);
  imported.initialize(3);
  Nf4FrozenBase nf4_cpu(imported, Device::CPU, DType::F32);
  Nf4FrozenBase nf4_gpu(imported, Device::CUDA, DType::BF16);
  FlatParameters dequantized(config);
  nf4_cpu.dequantize_into(dequantized);
  FlatParameters dequantized_gpu(config, Device::CUDA, DType::BF16);  // the bf16 rounding of it
  dequantized_gpu.assign_from(dequantized);
  const float scale = 1.0f / static_cast<float>(batch * seq);
  DecoderLM model_cpu(config, batch, seq);

  for (const ActivationCheckpoint mode : {ActivationCheckpoint::None, ActivationCheckpoint::Full})
    for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
      const char* recipe_name = recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise";
      SCOPED_TRACE(::testing::Message() << recipe_name << ", " << activation_checkpoint_name(mode));
      DecoderLM model_gpu(config, batch, seq, Device::CUDA, DType::BF16, mode);
      Fp8Projections fp8_q(config, frozen(recipe), Device::CUDA, batch * seq);
      Fp8Projections fp8_l(config, frozen(recipe), Device::CUDA, batch * seq);
      Fp8Projections fp8_c(config, frozen(recipe), Device::CPU, batch * seq);
      fp8_q.set_base(nf4_gpu);
      fp8_l.set_base(dequantized_gpu);
      fp8_c.set_base(nf4_cpu);
      LoraAdapters q(config, qlora_config(), Device::CUDA, batch * seq);
      LoraAdapters l(config, qlora_config(), Device::CUDA, batch * seq);
      LoraAdapters c(config, qlora_config(), Device::CPU, batch * seq);
      Rng rng(seed_for_current_test());
      set_adapters({&q, &l, &c}, rng);
      q.set_base(fp8_q);
      l.set_base(fp8_l);
      c.set_base(fp8_c);
      for (int step = 0; step < 2; ++step) {
        SCOPED_TRACE(::testing::Message() << "step " << step);
        const Tensor tokens = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
        const Tensor targets = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
        const Tensor tokens_gpu = tokens.to(Device::CUDA), targets_gpu = targets.to(Device::CUDA);
        for (LoraAdapters* side : {&q, &l, &c}) side->discard();
        const double loss_q = model_gpu.forward_backward(tokens_gpu, targets_gpu, q, q, scale).mean();
        const double loss_l = model_gpu.forward_backward(tokens_gpu, targets_gpu, l, l, scale).mean();
        const double loss_c = model_cpu.forward_backward(tokens, targets, c, c, scale).mean();
        const std::vector<float> grads_q = host_values<float>(q.gradient_flat());
        const std::vector<float> grads_l = host_values<float>(l.gradient_flat());
        size_t differing = 0;
        for (size_t i = 0; i < grads_q.size(); ++i) differing += grads_q[i] != grads_l[i];
        double worst = 0;
        for (size_t i = 0; i < c.gradients().size(); ++i) {
          const double error = relative_l2(to_cpu_f32(q.gradients()[i]), c.gradients()[i]);
          worst = std::max(worst, error);
          EXPECT_LT(error, 0.15) << c.master_names()[i];  // measured 0.104 (H200, qkv's A, step 0)
        }
        std::printf("%s, %s, step %d: QLoRA FP8 loss %.6f, LoRA FP8 on the dequantized bf16 base %.6f (%zu of %zu "
                    "gradient values differ); CPU %.6f (relative %.3g), adapters' gradients within %.3g of the CPU's\n",
                    recipe_name, std::string(activation_checkpoint_name(mode)).c_str(), step, loss_q, loss_l, differing,
                    grads_q.size(), loss_c, std::abs(loss_q - loss_c) / loss_c, worst);
        EXPECT_EQ(loss_q, loss_l);
        EXPECT_EQ(differing, 0u);
        EXPECT_NEAR(loss_q, loss_c, 1e-2 * loss_c);
        EXPECT_EQ(fp8_q.nonfinite_amax(), "");
        for (Fp8Projections* fp8 : {&fp8_q, &fp8_l, &fp8_c}) fp8->end_step(true);
      }
      EXPECT_EQ(fp8_q.delayed_state().active, recipe == Fp8Recipe::Delayed);
      if (recipe == Fp8Recipe::Delayed) EXPECT_EQ(fp8_q.delayed_state().scales, fp8_l.delayed_state().scales);
    }
}

}  // namespace
}  // namespace forge
