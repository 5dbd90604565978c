// QLoRA with precision.fp8 on Mixture-of-Experts and Multi-head Latent Attention models on
// the CPU reference (NOTE [FP8 over NF4 expert stacks] in model/nf4_base.cpp): the NF4
// expert stacks and MLA's NF4 projections under FP8 settings with the adapters on top;
// QLoRA FP8 training of a Mixtral-shaped and a DeepSeek-V2-shaped model (MLA, a dense first
// block, a shared expert) bitwise LoRA FP8 over the dequantized base (tensorwise and
// delayed, every activation-checkpointing mode: the blocks share one expert scratch, which
// is dequantized again before every use), and within FP8's error of QLoRA without FP8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/config.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "model/nf4_base.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "optim/optimizer.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::relative_l2;

struct Case {
  std::string name, model, targets;
};

// Mixtral-shaped (2 blocks of 4 experts, top-2) with all-linear: attention, the router and
// both expert stacks adapted. DeepSeek-V2-shaped (MLA, a dense first block, then 8 experts
// top-2 and a shared expert) with every kind of adapter, as ModelFp8LoraMoe.
std::vector<Case> cases() {
  return {{"mixtral", "debug-tiny-moe", "all-linear"},
          {"deepseek_v2", "debug-tiny-mla",
           "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,up_proj,down_proj,gate,experts.gate_up_proj,"
           "experts.down_proj"}};
}

ModelConfig model_of(const Case& c) { return load_experiment("", {{"model.name", c.model}}).model; }

LoraConfig qlora(const std::string& targets) {
  LoraConfig l;
  l.rank = 4;
  l.alpha = 8.0;
  l.dropout = 0.0;  // PEFT's parameter adapters (the router, the experts) take none
  l.target_modules = targets;
  l.quantize_base = "nf4";
  return l;
}

Fp8Settings frozen(Fp8Recipe recipe) {
  Fp8Settings s;
  s.recipe = recipe;
  s.frozen = true;
  s.amax_history_length = 4;
  return s;
}

constexpr int64_t kBatch = 2, kSeq = 16;

// Adapters (B nonzero, so A has gradients too) over `base`, or over FP8 projections of it.
struct AdapterRun {
  std::optional<Fp8Projections> fp8;
  std::unique_ptr<LoraAdapters> adapters;
  std::unique_ptr<AdamW> optimizer;

  AdapterRun(const ModelConfig& config, const Case& c, ParamSource& base, const std::optional<Fp8Settings>& settings) {
    adapters = std::make_unique<LoraAdapters>(config, qlora(c.targets), Device::CPU, kBatch * kSeq);
    adapters->initialize(2);
    testing::set_nonzero_lora_b(*adapters);
    if (settings) {
      fp8.emplace(config, *settings, Device::CPU, kBatch * kSeq);
      fp8->set_base(base);
      adapters->set_base(*fp8);
    } else {
      adapters->set_base(base);
    }
    OptimizerConfig oc;
    oc.lr = 1e-2;
    optimizer = std::make_unique<AdamW>(oc, adapters->masters(), std::vector<bool>(adapters->masters().size(), true));
  }

  // One optimizer step over one micro-batch: its loss; the adapters' gradients stay.
  double step(DecoderLM& model, const ModelConfig& config, int step) {
    const Tensor tokens = testing::random_tokens(kBatch, kSeq, config.vocab_size, 1 + static_cast<uint64_t>(step));
    Tensor targets = Tensor::empty({kBatch, kSeq}, DType::I32);
    for (int64_t i = 0; i < kBatch * kSeq; ++i)  // learnable: the next id
      targets.data<int32_t>()[i] = static_cast<int32_t>((tokens.data<int32_t>()[i] + 1) % config.vocab_size);
    adapters->set_dropout_step(7, static_cast<uint64_t>(step));
    adapters->discard();
    const LossSum loss = model.forward_backward(tokens, targets, *adapters, *adapters, 1.0f / (kBatch * kSeq));
    if (fp8) {
      EXPECT_EQ(fp8->nonfinite_amax(), "");
      fp8->end_step(true);
    }
    optimizer->step(adapters->gradients(), 1e-2);
    adapters->refresh_compute();
    return loss.mean();
  }
};

// Through FP8 projections of the NF4 base, every quantized projection carries its NF4 codes
// and FP8 settings, every NF4 expert stack its FP8 settings and Fp8ExpertStack (a plain
// weight over the dequantized scratch), the router neither; the adapters sit on top.
TEST(ModelQloraFp8Moe, DescriptorsCarryNf4AndFp8UnderTheAdapters) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const ModelConfig m = model_of(c);
    FlatParameters imported(m);
    imported.initialize(3);
    Nf4FrozenBase nf4(imported, Device::CPU, DType::F32);
    AdapterRun run(m, c, nf4, frozen(Fp8Recipe::Tensorwise));
    std::vector<size_t> entry(static_cast<size_t>(m.num_layers), 0);
    int64_t stacks = 0, projections = 0;
    for (const ParamSpec& spec : parameter_specs(m)) {
      if (spec.layer < 0) continue;
      const size_t k = entry[static_cast<size_t>(spec.layer)]++;
      const LinearWeight& w = run.adapters->layer(spec.layer).params.at(k);
      const bool router = fp8_moe_router(spec);
      EXPECT_EQ(w.fp8 != nullptr, (spec.shape.size() == 2 && !router) || spec.expert_stack) << spec.name;
      EXPECT_EQ(w.nf4 != nullptr, is_base_projection(spec)) << spec.name;
      projections += w.nf4 && w.fp8 ? 1 : 0;
      if (spec.expert_stack) {
        ++stacks;
        EXPECT_NE(w.experts_lora, nullptr) << spec.name;
        ASSERT_NE(w.fp8->experts, nullptr) << spec.name;  // NOTE [FP8 expert stack state]
        EXPECT_EQ(w.fp8->experts->experts(), spec.shape[0]) << spec.name;
        EXPECT_EQ(w.weight.shape(), spec.shape) << spec.name;
      }
    }
    EXPECT_EQ(stacks, 4);  // two MoE blocks, gate/up and down each
    EXPECT_GT(projections, 0);
  }
}

// Four optimizer steps of QLoRA with FP8 and of LoRA with FP8 over the dequantized base:
// the same losses, adapter gradients and adapters, bitwise, with either recipe and in every
// activation-checkpointing mode (the backward and a recomputed forward dequantize the
// shared expert scratch again before casting, NOTE [FP8 over NF4 expert stacks]).
TEST(ModelQloraFp8Moe, TrainingEqualsLoraWithFp8OnTheDequantizedBase) {
  for (const Case& c : cases())
    for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed})
      for (const ActivationCheckpoint mode :
           {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
        SCOPED_TRACE(::testing::Message() << c.name << ", delayed " << (recipe == Fp8Recipe::Delayed)
                                          << ", checkpoint " << static_cast<int>(mode));
        const ModelConfig m = model_of(c);
        FlatParameters imported(m), dequantized(m);
        imported.initialize(11);
        Nf4FrozenBase nf4(imported, Device::CPU, DType::F32);
        nf4.dequantize_into(dequantized);
        ASSERT_FALSE(bitwise_equal(imported.flat(), dequantized.flat()));  // NF4 did round
        AdapterRun q(m, c, nf4, frozen(recipe)), l(m, c, dequantized, frozen(recipe));
        DecoderLM model(m, kBatch, kSeq, Device::CPU, DType::F32, mode);
        for (int step = 0; step < 4; ++step) {
          ASSERT_EQ(q.step(model, m, step), l.step(model, m, step)) << "step " << step;
          ASSERT_TRUE(bitwise_equal(q.adapters->gradient_flat(), l.adapters->gradient_flat())) << "step " << step;
        }
        EXPECT_TRUE(bitwise_equal(q.adapters->master_flat(), l.adapters->master_flat()));
        if (recipe == Fp8Recipe::Delayed) {
          const Fp8DelayedState a = q.fp8->delayed_state(), b = l.fp8->delayed_state();
          EXPECT_TRUE(a.active);
          EXPECT_EQ(a.scales, b.scales);
          EXPECT_EQ(a.histories, b.histories);
        }
      }
}

// QLoRA with FP8 follows QLoRA without it within FP8's error, the tolerances of
// ModelQloraFp8.TrainingTracksQloraWithoutFp8 (losses of 6 optimizer steps within 1%, the
// first step's adapter gradients within 20% relative L2). Measured: the losses within 0.16%
// (tensorwise) and 0.12% (delayed) Mixtral-shaped, 0.31% and 0.38% DeepSeek-shaped (3.44 ->
// 3.03 and 3.43 -> 3.24 over the 6 steps); the first step's adapter gradients within 5.9%
// and 6.9%.
TEST(ModelQloraFp8Moe, TrainingTracksQloraWithoutFp8) {
  for (const Case& c : cases()) {
    const ModelConfig m = model_of(c);
    FlatParameters imported(m);
    imported.initialize(11);
    Nf4FrozenBase nf4(imported, Device::CPU, DType::F32);
    for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
      const std::string name = c.name + (recipe == Fp8Recipe::Delayed ? " delayed" : " tensorwise");
      SCOPED_TRACE(name);
      AdapterRun fp8(m, c, nf4, frozen(recipe)), plain(m, c, nf4, std::nullopt);
      DecoderLM model(m, kBatch, kSeq);
      double worst_loss = 0, first_gradient = 0;
      std::vector<double> losses;
      for (int step = 0; step < 6; ++step) {
        const double a = fp8.step(model, m, step), b = plain.step(model, m, step);
        EXPECT_NE(a, b) << "step " << step;  // FP8 did run
        losses.push_back(a);
        worst_loss = std::max(worst_loss, std::abs(a - b) / b);
        if (step > 0) continue;
        first_gradient = relative_l2(fp8.adapters->gradient_flat(), plain.adapters->gradient_flat());
      }
      std::printf("QLoRA + FP8 %s vs QLoRA: loss %.4f -> %.4f, losses within %.3g%% (relative, 6 steps), the first "
                  "step's adapter gradients within %.3g%% (relative L2)\n",
                  name.c_str(), losses.front(), losses.back(), 100 * worst_loss, 100 * first_gradient);
      EXPECT_LT(losses.back(), losses.front());
      EXPECT_LT(worst_loss, 0.01);
      EXPECT_LT(first_gradient, 0.2);
      EXPECT_GT(first_gradient, 0.0);
    }
  }
}

}  // namespace
}  // namespace forge
