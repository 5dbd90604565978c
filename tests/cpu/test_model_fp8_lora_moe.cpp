// LoRA with precision.fp8 on Mixture-of-Experts and Multi-head Latent Attention models on
// the CPU reference (NOTE [FP8 frozen routed experts] in ops/moe_fp8.h, NOTE [FP8 frozen
// base] in model/fp8_projections.h): the descriptors carry FP8 on every frozen projection
// and routed expert stack (not the router) with the adapters on top and no base gradient;
// LoRA training of a Mixtral-shaped and a DeepSeek-V2-shaped model (MLA, a dense first
// block, a shared expert) with the base's GEMMs in FP8, tensorwise and delayed, against
// fp32 LoRA from the same base and adapters; the frozen base untouched; and the config
// rules. The frozen experts' op against a quantize/dequantize reference is in
// tests/cpu/test_ops_moe_fp8.cpp.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "cli/config.h"
#include "config_test_support.h"
#include "core/rng.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "model_testing.h"
#include "ops_testing.h"

namespace forge {
namespace {

using config_test::expect_error;
using testing::relative_l2;

ExperimentConfig load(ConfigOverrides overrides) { return load_experiment("", overrides); }

struct Case {
  std::string name, model, targets;
};

// Mixtral-shaped (2 blocks of 4 experts, top-2) with all-linear: attention, the router and
// both expert stacks adapted. DeepSeek-V2-shaped (MLA, a dense first block, then 8 experts
// top-2 and a shared expert) with every kind of adapter: MLA's projections, the dense
// block's and shared expert's feed-forward, the router and the routed experts.
std::vector<Case> cases() {
  return {{"mixtral", "debug-tiny-moe", "all-linear"},
          {"deepseek_v2", "debug-tiny-mla",
           "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,up_proj,down_proj,gate,experts.gate_up_proj,"
           "experts.down_proj"}};
}

ModelConfig model_of(const Case& c) { return load({{"model.name", c.model}}).model; }

LoraConfig lora_config(const std::string& targets) {
  LoraConfig l;
  l.rank = 4;
  l.alpha = 8.0;
  l.target_modules = targets;
  return l;
}

Fp8Settings frozen(Fp8Recipe recipe) {
  Fp8Settings s;
  s.recipe = recipe;
  s.frozen = true;
  if (recipe == Fp8Recipe::Delayed) s.amax_history_length = 4;
  return s;
}

// A and B random (PEFT starts B at zero): every adapter has a gradient from the first step.
void randomize(LoraAdapters& adapters, uint64_t seed) {
  adapters.initialize(seed);
  Rng rng(seed + 1);
  for (size_t k = 0; k < adapters.targets().size(); ++k)
    for (size_t p = 0; p < adapters.targets()[k].parts.size(); ++p) {
      Tensor b = adapters.part_matrix(k, p, 'b');
      for (int64_t i = 0; i < b.numel(); ++i) b.data<float>()[i] = static_cast<float>(0.05 * rng.normal());
      adapters.set_part_matrix(k, p, 'b', b);
    }
}

// Every frozen projection and expert stack carries FP8 under the adapters, the router does
// not; the gradient side is LoraAdapters' alone (no base tensor, no FP8), an adapted
// stack's with its adapters.
TEST(ModelFp8LoraMoe, DescriptorsCarryFp8UnderTheAdapters) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const ModelConfig m = model_of(c);
    FlatParameters base(m);
    Fp8Projections fp8(m, frozen(Fp8Recipe::Tensorwise), Device::CPU, 32);
    fp8.set_base(base);
    LoraAdapters adapters(m, lora_config(c.targets), Device::CPU, 32);
    adapters.set_base(fp8);
    std::vector<size_t> entry(static_cast<size_t>(m.num_layers), 0);
    int64_t stacks = 0;
    for (const ParamSpec& spec : parameter_specs(m)) {
      if (spec.layer < 0) continue;
      const size_t k = entry[static_cast<size_t>(spec.layer)]++;
      const LinearWeight& w = adapters.layer(spec.layer).params.at(k);
      const LinearWeight& g = adapters.layer_grads(spec.layer).params.at(k);
      const bool router = fp8_moe_router(spec);
      EXPECT_EQ(w.fp8 != nullptr, (spec.shape.size() == 2 && !router) || spec.expert_stack) << spec.name;
      EXPECT_EQ(g.fp8, nullptr) << spec.name;
      if (spec.shape.size() >= 2) EXPECT_FALSE(g.weight.defined()) << spec.name;
      if (router) EXPECT_NE(w.lora, nullptr) << spec.name;  // 'gate' adapted, in the compute dtype
      if (spec.expert_stack) {
        ++stacks;
        EXPECT_NE(w.experts_lora, nullptr) << spec.name;
        EXPECT_EQ(g.experts_lora, w.experts_lora) << spec.name;
        ASSERT_NE(w.fp8->experts, nullptr) << spec.name;  // NOTE [FP8 expert stack state]
        EXPECT_EQ(w.fp8->experts->experts(), spec.shape[0]) << spec.name;
      }
    }
    EXPECT_EQ(stacks, 4);  // two MoE blocks, gate/up and down each
  }
}

struct LoraRun {
  std::vector<double> losses;
  Tensor first_gradients;  // the adapters', flat
};

constexpr int kSteps = 10;
// At 0.5 the fp32 run's own curve is not monotone on these models (a step that moves a few
// routing choices), and FP8's rounding then sends the two runs apart; 0.1 descends smoothly.
constexpr float kLearningRate = 0.1f;

// kSteps SGD steps (kLearningRate) of the adapters on a batch of 4 x 16 tokens from the same base
// and adapters, with the base's GEMMs in fp32 (no settings) or FP8.
LoraRun train(const Case& c, const Fp8Settings* settings, const FlatParameters& base) {
  const ModelConfig m = model_of(c);
  const int64_t batch = 4, seq = 16;
  const Tensor tokens = testing::random_tokens(batch, seq, m.vocab_size, 11);
  Tensor targets = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i)
    targets.data<int32_t>()[i] = static_cast<int32_t>((tokens.data<int32_t>()[i] + 1) % m.vocab_size);
  LoraAdapters adapters(m, lora_config(c.targets), Device::CPU, batch * seq);
  randomize(adapters, 5);
  FlatParameters& frozen_base = const_cast<FlatParameters&>(base);  // handed out, never written
  std::unique_ptr<Fp8Projections> fp8;
  if (settings) {
    fp8 = std::make_unique<Fp8Projections>(m, *settings, Device::CPU, batch * seq);
    fp8->set_base(frozen_base);
    adapters.set_base(*fp8);
  } else {
    adapters.set_base(frozen_base);
  }
  DecoderLM model(m, batch, seq);
  LoraRun run;
  for (int step = 0; step < kSteps; ++step) {
    adapters.discard();
    run.losses.push_back(model.forward_backward(tokens, targets, adapters, adapters, 1.0f / (batch * seq)).mean());
    if (step == 0) run.first_gradients = adapters.gradient_flat().clone();
    if (fp8) {
      EXPECT_EQ(fp8->nonfinite_amax(), "");
      fp8->end_step(true);
    }
    float* p = adapters.master_flat().data<float>();
    const float* g = adapters.gradient_flat().data<float>();
    for (int64_t i = 0; i < adapters.master_flat().numel(); ++i) p[i] -= kLearningRate * g[i];
  }
  return run;
}

// Tolerances as ModelFp8Moe's full FP8 training (first loss 1%, every step 2%, gradients
// 25% relative L2) and ModelFp8Lora's dense frozen base: the adapters' gradients pass
// through the frozen FP8 GEMMs' forward and input gradients (the routed experts' with a
// few rows each). Measured over 10 steps (the loss 3.51 -> 3.36 Mixtral-shaped, 3.48 -> 3.28
// DeepSeek-shaped): every step's loss within 0.05% (Mixtral-shaped) and 0.10% (DeepSeek-
// shaped) of fp32 LoRA's, tensorwise and delayed; the first step's adapter gradients within
// 4.7% and 7.2% (relative L2 over all adapters). A wrong frozen expert GEMM (a missing
// adapter share, an operand transposed, a scale missing) is off by 50% or more.
TEST(ModelFp8LoraMoe, TrainingTracksFp32Lora) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const ModelConfig m = model_of(c);
    FlatParameters base(m);
    base.initialize(3);
    const Tensor before = base.flat().clone();
    const LoraRun fp32 = train(c, nullptr, base);
    EXPECT_LT(fp32.losses.back(), 0.97 * fp32.losses.front());
    for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
      const std::string name = c.name + (recipe == Fp8Recipe::Delayed ? " delayed" : " tensorwise");
      const Fp8Settings s = frozen(recipe);
      const LoraRun fp8 = train(c, &s, base);
      EXPECT_NE(fp8.losses[0], fp32.losses[0]) << name;  // FP8 did run
      EXPECT_NEAR(fp8.losses[0], fp32.losses[0], 0.01 * fp32.losses[0]) << name;
      double worst = 0.0;
      for (int step = 0; step < kSteps; ++step) {
        EXPECT_NEAR(fp8.losses[step], fp32.losses[step], 0.02 * fp32.losses[step]) << name << " step " << step;
        worst = std::max(worst, std::abs(fp8.losses[step] - fp32.losses[step]) / fp32.losses[step]);
      }
      const double error = relative_l2(fp8.first_gradients, fp32.first_gradients);
      EXPECT_LT(error, 0.25) << name;
      EXPECT_GT(error, 0.0) << name;
      std::printf("%s: loss %.4f -> %.4f (fp32 %.4f -> %.4f), worst step's loss off by %.3f%%, first adapter "
                  "gradients off by %.2f%% (relative L2)\n",
                  name.c_str(), fp8.losses.front(), fp8.losses.back(), fp32.losses.front(), fp32.losses.back(),
                  100.0 * worst, 100.0 * error);
      for (int step = 0; step < kSteps; ++step) std::printf(" %.4f/%.4f", fp8.losses[step], fp32.losses[step]);
      std::printf(" (each step's FP8/fp32 loss)\n");
    }
    EXPECT_TRUE(testing::bitwise_equal(base.flat(), before));  // the frozen base is untouched
  }
}

// The expert adapters' gradients alone (those that the frozen FP8 experts carry) track
// fp32 LoRA's too, so the tolerance above is not met by the other adapters alone. Measured:
// 11.0% (relative L2; their few rows per expert, as ModelFp8Moe's experts' 15.5%).
TEST(ModelFp8LoraMoe, ExpertAdapterGradientsTrackFp32Lora) {
  const Case c{"mixtral_experts", "debug-tiny-moe", "experts.gate_up_proj,experts.down_proj"};
  FlatParameters base(model_of(c));
  base.initialize(9);
  const LoraRun fp32 = train(c, nullptr, base);
  const Fp8Settings s = frozen(Fp8Recipe::Tensorwise);
  const LoraRun fp8 = train(c, &s, base);
  const double error = relative_l2(fp8.first_gradients, fp32.first_gradients);
  std::printf("experts' adapters only: first gradients off by %.2f%% (relative L2), last loss %.4f vs %.4f\n",
              100.0 * error, fp8.losses.back(), fp32.losses.back());
  EXPECT_LT(error, 0.25);
  EXPECT_GT(error, 0.0);
  for (int step = 0; step < kSteps; ++step) EXPECT_NEAR(fp8.losses[step], fp32.losses[step], 0.02 * fp32.losses[step]);
}

TEST(ModelFp8LoraMoe, ConfigRules) {
  // Accepted: LoRA over an FP8 frozen base on MoE and MLA models, the experts' adapters
  // too, both recipes, under expert parallelism and on CUDA widths that are multiples of 16.
  for (const char* model : {"debug-tiny-moe", "debug-tiny-mla"})
    for (const char* recipe : {"tensorwise", "delayed"})
      for (const char* targets : {"q_proj,o_proj", "all-linear", "experts.gate_up_proj,experts.down_proj"})
        EXPECT_EQ(load({{"model.name", model}, {"precision.fp8", recipe}, {"lora.rank", "8"},
                        {"lora.target_modules", targets}})
                      .precision.fp8,
                  recipe);
  EXPECT_EQ(load({{"model.name", "debug-tiny-moe"}, {"precision.fp8", "delayed"}, {"lora.rank", "8"},
                  {"lora.target_modules", "all-linear"}, {"parallelism.data_parallel_shard_degree", "2"},
                  {"parallelism.expert_parallel_degree", "2"}})
                .parallelism.expert_parallel_degree,
            2);
  EXPECT_EQ(load({{"model.name", "debug-tiny-mla"}, {"precision.fp8", "tensorwise"}, {"lora.rank", "8"},
                  {"training.device", "cuda"}, {"training.local_batch_size", "1"}, {"training.seq_len", "60"}})
                .precision.fp8,
            "tensorwise");  // a frozen base contracts no tokens: any micro-batch
  // QLoRA's NF4 base too (NOTE [FP8 over NF4 expert stacks]; tests/cpu/test_model_qlora_fp8_moe.cpp).
  EXPECT_EQ(load({{"model.name", "debug-tiny-moe"}, {"precision.fp8", "tensorwise"}, {"lora.rank", "8"},
                  {"lora.quantize_base", "nf4"}})
                .lora.quantize_base,
            "nf4");
  // Still refused: widths on CUDA.
  expect_error([] { load({{"model.name", "debug-tiny-mla"}, {"precision.fp8", "tensorwise"}, {"lora.rank", "8"},
                          {"training.device", "cuda"}, {"training.local_batch_size", "1"}, {"training.seq_len", "64"},
                          {"model.moe_ffn_hidden_size", "40"}}); },
               {"multiple of 16", "model.moe_ffn_hidden_size (the routed and shared experts' width) is 40"});
}

}  // namespace
}  // namespace forge
