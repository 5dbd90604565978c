// QLoRA with FP8 on Mixture-of-Experts and Multi-head Latent Attention models on the GPU
// (NOTE [FP8 over NF4 expert stacks] in model/nf4_base.cpp): a Mixtral-shaped and a
// DeepSeek-V2-shaped model (MLA, a dense first block, shared experts) whose NF4 expert stacks
// are dequantized block by block into one bf16 scratch and cast to E4M3 per expert, and whose
// NF4 projections (MLA's among them) are dequantized and cast per GEMM; adapters on attention
// or MLA, the router and both expert stacks.
//  - Against LoRA with FP8 over a bf16 base holding the same dequantized values (the GPU's
//    bf16 dequantization is bitwise the CPU's fp32 one rounded to bf16, GpuQlora): the same
//    W values give the same amaxes, codes and GEMMs, so the losses and adapter gradients
//    must be bitwise equal over two steps (delayed: the second on the delayed scales), with
//    and without activation checkpointing's recomputation. This checks that the experts'
//    forward statistics, reused by the backward, stay right although every block's stacks
//    share one scratch (dequantized again before the backward and the recomputation).
//  - Against the CPU reference (QLoRA FP8 over the fp32 dequantized base, the same bf16
//    rest of the base): the loss within 1%; the adapters' gradients within 15% (GpuQloraFp8's
//    bound) when no assignment moved, else 60% (GpuFp8LoraMoe's: a moved assignment changes
//    its token's block output wholly).
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

LoraConfig qlora_config(const std::string& targets) {
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 16;
  lora.target_modules = targets;
  lora.quantize_base = "nf4";
  return lora;
}

Fp8Settings frozen(Fp8Recipe recipe) {
  Fp8Settings s;
  s.recipe = recipe;
  s.frozen = true;
  s.amax_history_length = 16;
  s.weight_cache = false;  // as fp8_settings_of under QLoRA
  return s;
}

struct Case {
  ModelConfig model;
  std::string targets;
};

std::vector<Case> cases() {
  ModelConfig moe = small_moe();
  moe.name = "gpu-test-qlora-fp8-moe";
  ModelConfig deepseek = small_deepseek(false);
  deepseek.name = "gpu-test-qlora-fp8-deepseek-v2";
  deepseek.rope_scaling = RopeScaling{};
  return {{moe, "all-linear"},
          {deepseek,
           "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,up_proj,down_proj,gate,experts.gate_up_proj,"
           "experts.down_proj"}};
}

// The same bf16 values of A and B on every side (B random and small: B = 0 gives A no
// gradient; small keeps the adapted routers without near ties).
void set_adapters(const std::vector<LoraAdapters*>& sides, Rng& rng) {
  LoraAdapters& first = *sides.front();
  first.initialize(9);
  for (size_t k = 0; k < first.targets().size(); ++k)
    for (size_t p = 0; p < first.targets()[k].parts.size(); ++p) {
      const LoraPart& part = first.targets()[k].parts[p];
      const LoraTarget& t = first.targets()[k];  // PEFT's expert B [out, r E] (all-linear's gate_up: 2 r)
      const int64_t columns = first.lora_config().rank * t.rank_multiple * std::max<int64_t>(t.experts, 1);
      first.set_part_matrix(k, p, 'b', random_bf16_values({part.row_end - part.row_begin, columns}, rng, 0.02));
    }
  round_to_bf16(first.master_flat());
  first.refresh_compute();
  for (size_t i = 1; i < sides.size(); ++i) {
    sides[i]->master_flat().copy_from(first.master_flat().to(sides[i]->master_flat().device()));
    sides[i]->refresh_compute();
  }
}

TEST(GpuQloraFp8Moe, TrainingEqualsLoraFp8OnTheDequantizedBaseAndTracksTheCpu) {
  for (const Case& c : cases()) {
    const ModelConfig& m = c.model;
    const int64_t batch = 2, seq = 64;
    Rng rng(seed_for_current_test());
    FlatParameters imported(m);
    imported.initialize(31);
    separate_router_choices(imported, rng);  // NOTE [Routers without near ties]
    round_to_bf16(imported.flat());          // the router, norms and embedding the same on every side
    Nf4FrozenBase nf4_cpu(imported, Device::CPU, DType::F32);
    Nf4FrozenBase nf4_gpu(imported, Device::CUDA, DType::BF16);
    FlatParameters dequantized(m);
    nf4_cpu.dequantize_into(dequantized);
    FlatParameters dequantized_gpu(m, Device::CUDA, DType::BF16);  // the bf16 rounding of it
    dequantized_gpu.assign_from(dequantized);
    const float scale = 1.0f / static_cast<float>(batch * seq);
    DecoderLM model_cpu(m, batch, seq);
    for (const ActivationCheckpoint mode : {ActivationCheckpoint::None, ActivationCheckpoint::Full})
      for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
        const char* recipe_name = recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise";
        SCOPED_TRACE(::testing::Message() << m.name << ", " << recipe_name << ", " << activation_checkpoint_name(mode));
        DecoderLM model_gpu(m, batch, seq, Device::CUDA, DType::BF16, mode);
        Fp8Projections fp8_q(m, frozen(recipe), Device::CUDA, batch * seq);
        Fp8Projections fp8_l(m, frozen(recipe), Device::CUDA, batch * seq);
        Fp8Projections fp8_c(m, frozen(recipe), Device::CPU, batch * seq);
        fp8_q.set_base(nf4_gpu);
        fp8_l.set_base(dequantized_gpu);
        fp8_c.set_base(nf4_cpu);
        LoraAdapters q(m, qlora_config(c.targets), Device::CUDA, batch * seq);
        LoraAdapters l(m, qlora_config(c.targets), Device::CUDA, batch * seq);
        LoraAdapters cpu(m, qlora_config(c.targets), Device::CPU, batch * seq);
        set_adapters({&cpu, &q, &l}, rng);
        q.set_base(fp8_q);
        l.set_base(fp8_l);
        cpu.set_base(fp8_c);
        for (int step = 0; step < 2; ++step) {
          SCOPED_TRACE(::testing::Message() << "step " << step);
          const Tensor tokens = random_ids(batch * seq, m.vocab_size, rng).view({batch, seq});
          const Tensor targets = random_ids(batch * seq, m.vocab_size, rng).view({batch, seq});
          const Tensor tokens_gpu = tokens.to(Device::CUDA), targets_gpu = targets.to(Device::CUDA);
          for (LoraAdapters* side : {&q, &l, &cpu}) side->discard();
          const double loss_q = model_gpu.forward_backward(tokens_gpu, targets_gpu, q, q, scale).mean();
          const std::vector<std::vector<int64_t>> load_gpu = model_gpu.expert_load();
          const double loss_l = model_gpu.forward_backward(tokens_gpu, targets_gpu, l, l, scale).mean();
          const double loss_c = model_cpu.forward_backward(tokens, targets, cpu, cpu, scale).mean();
          const std::vector<float> grads_q = host_values<float>(q.gradient_flat());
          const std::vector<float> grads_l = host_values<float>(l.gradient_flat());
          size_t differing = 0;
          for (size_t i = 0; i < grads_q.size(); ++i) differing += grads_q[i] != grads_l[i];
          const int64_t moved = assignments_moved(model_cpu.expert_load(), load_gpu);
          const int64_t assignments = (m.num_layers - m.first_dense_layers) * batch * seq * m.num_experts_per_tok;
          double worst = 0;
          const std::vector<std::string> names = cpu.master_names();  // by value: keep it alive
          for (size_t i = 0; i < cpu.gradients().size(); ++i) {
            const double error = relative_l2(to_cpu_f32(q.gradients()[i]), cpu.gradients()[i]);
            worst = std::max(worst, error);
            // With moved assignments the router's adapters the most, as GpuQlora's (the H200 run,
            // 2026-12-04: up to 0.706 with 11 of 512 moved, the other adapters within 0.46).
            const bool router = names[i].find(".moe.router") != std::string::npos;
            EXPECT_LT(error, moved == 0 ? 0.15 : router ? 0.8 : 0.6) << names[i] << " (" << moved << " moved)";
          }
          std::printf("%s %s %s step %d: QLoRA FP8 loss %.6f, LoRA FP8 on the dequantized bf16 base %.6f (%zu of %zu "
                      "gradient values differ); CPU %.6f (relative %.3g, %ld of %ld assignments moved), adapters' "
                      "gradients within %.3g of the CPU's\n",
                      m.name.c_str(), recipe_name, std::string(activation_checkpoint_name(mode)).c_str(), step, loss_q,
                      loss_l, differing, grads_q.size(), loss_c, std::abs(loss_q - loss_c) / loss_c,
                      static_cast<long>(moved), static_cast<long>(assignments), worst);
          EXPECT_EQ(loss_q, loss_l);
          EXPECT_EQ(differing, 0u);
          EXPECT_LE(moved * 100, 3 * assignments);
          EXPECT_NEAR(loss_q, loss_c, 1e-2 * loss_c);
          EXPECT_EQ(fp8_q.nonfinite_amax(), "");
          for (Fp8Projections* fp8 : {&fp8_q, &fp8_l, &fp8_c}) fp8->end_step(true);
        }
        EXPECT_EQ(fp8_q.delayed_state().active, recipe == Fp8Recipe::Delayed);
        if (recipe == Fp8Recipe::Delayed) EXPECT_EQ(fp8_q.delayed_state().scales, fp8_l.delayed_state().scales);
      }
  }
}

}  // namespace
}  // namespace forge
