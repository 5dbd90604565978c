// DeepSeek-shaped models (issue 20): Multi-head Latent Attention (model.kv_lora_rank, NOTE
// [Multi-head Latent Attention] in model/latent_attention.h), shared experts and dense first
// blocks (NOTE [MoE feed-forward] in model/moe_feed_forward.h, SplitByLayer). The parameter
// and FLOP accounting against the published models' sizes (transformers' counts of the same
// configs), the config rules, the blocks' parameters, a finite-difference check of the whole
// model's gradient, and a small model trained on the CPU under every checkpointing mode.
// The model's numbers are checked against transformers' DeepseekV2ForCausalLM in the Python
// tests.
#include <gtest/gtest.h>

#include <cmath>

#include "cli/config.h"
#include "config_test_support.h"
#include "core/rng.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"

namespace forge {
namespace {

using config_test::expect_error;

ExperimentConfig load(const ConfigOverrides& overrides) { return load_experiment("", overrides); }

ExperimentConfig load_tiny(ConfigOverrides overrides = {}) {
  overrides.insert(overrides.begin(), {{"model.name", "debug-tiny-mla"}});
  return load(overrides);
}

// transformers 5.23 counts the parameters of DeepseekV2ForCausalLM / DeepseekV3ForCausalLM
// built from the same configs (on the meta device): 15,706,484,224 for DeepSeek-V2-Lite,
// 235,741,434,880 for DeepSeek-V2 and 671,026,404,352 for DeepSeek-V3 without its
// multi-token-prediction module. V3's routing
// biases (58 MoE blocks x 256) are buffers there and parameters (without gradient) in forge.
TEST(ModelDeepseek, CountsAreTransformers) {
  const ModelConfig lite = load({{"model.name", "deepseek-v2-lite"}}).model;
  EXPECT_EQ(lite.total_params(), 15706484224);
  EXPECT_EQ(lite.active_params(), 15706484224 - 26 * (64 - 6) * int64_t{3 * 2048 * 1408});  // 2.66 B
  EXPECT_EQ(lite.layer_params(0) + 26 * lite.layer_params(1) + 2 * 102400 * 2048 + 2048, lite.total_params());
  EXPECT_LT(lite.layer_params(0), lite.layer_params(1));
  EXPECT_EQ(lite.largest_layer_params(), lite.layer_params(1));
  // FLOPs per token: the attention's products are heads x (192 + 128) / 2 wide.
  EXPECT_DOUBLE_EQ(lite.flops_per_token(4096),
                   6.0 * static_cast<double>(lite.active_params() - 102400 * 2048) + 6.0 * 27 * 16 * 160 * 4096.0);
  const ModelConfig v2 = load({{"model.name", "deepseek-v2"}}).model;
  EXPECT_EQ(v2.total_params(), 235741434880);
  EXPECT_EQ(v2.active_params(), v2.total_params() - 59 * (160 - 6) * int64_t{3 * 5120 * 1536});  // 21.4 B
  const ModelConfig v3 = load({{"model.name", "deepseek-v3"}}).model;
  EXPECT_EQ(v3.total_params(), 671026404352 + 58 * 256);
  EXPECT_EQ(v3.active_params(), v3.total_params() - 58 * (256 - 8) * int64_t{3 * 7168 * 2048});  // 37.6 B
  const ModelConfig titan = load({{"model.name", "deepseek-v3-16b"}}).model;
  EXPECT_EQ(titan.total_params(), lite.total_params());  // the same architecture
  int64_t sum = 0;
  for (const ParamSpec& spec : parameter_specs(lite)) sum += shape_numel(spec.shape);
  EXPECT_EQ(sum, lite.total_params());
}

TEST(ModelDeepseek, ConfigRules) {
  expect_error([] { load_tiny({{"model.first_dense_layers", "3"}}); },
               {"model.first_dense_layers = 3 (command line) must be less than model.num_layers = 3"});
  expect_error([] { load_tiny({{"model.num_kv_heads", "2"}}); },
               {"model.num_kv_heads = 2 (command line) must equal model.num_heads = 4", "with Multi-head Latent"});
  expect_error([] { load_tiny({{"model.qk_rope_head_dim", "7"}}); }, {"model.qk_rope_head_dim = 7", "must be even"});
  expect_error([] { load_tiny({{"model.qk_rope_head_dim", "8"}, {"training.device", "cuda"}}); },
               {"model.qk_rope_head_dim = 8 (command line) must be a multiple of 16 on CUDA"});
  expect_error([] { load_tiny({{"model.router_score_function", "sigmoid"}, {"model.router_aux_loss_coef", "0.01"}}); },
               {"the Switch balancing loss is for softmax routing"});
  expect_error([] { load_tiny({{"model.router_score_function", "sigmoid"}, {"model.router_num_groups", "3"}}); },
               {"model.router_num_groups = 3 (command line) must divide model.num_experts = 8"});
  expect_error([] { load_tiny({{"model.sliding_window", "16"}}); }, {"Multi-head Latent Attention has no sliding window"});
  expect_error([] { load({{"model.num_shared_experts", "1"}}); },
               {"model.num_shared_experts = 1 (command line) needs model.num_experts > 0"});
  expect_error([] { load({{"model.v_head_dim", "16"}}); },
               {"model.v_head_dim = 16 (command line) needs model.kv_lora_rank > 0"});
  expect_error([] { load({{"model.rope_scaling.type", "ntk"}}); }, {"model.rope_scaling.type"});
  expect_error([] { load_tiny({{"model.rope_scaling.enabled", "true"}, {"model.rope_scaling.type", "yarn"},
                               {"model.rope_scaling.beta_fast", "1"}}); },
               {"model.rope_scaling.beta_fast = 1 (command line) must be greater than model.rope_scaling.beta_slow"});
  // FP8 on MLA and MoE models: tests/cpu/test_model_fp8_moe.cpp.
  EXPECT_EQ(load_tiny({{"precision.fp8", "delayed"}}).precision.fp8, "delayed");
  // Group-limited sigmoid routing is DeepSeek-V3's, and takes the keys.
  const ModelConfig v3ish = load_tiny({{"model.router_score_function", "sigmoid"}, {"model.router_num_groups", "4"},
                                       {"model.router_topk_groups", "2"}, {"model.router_scaling_factor", "2.5"}})
                                .model;
  EXPECT_EQ(v3ish.router_num_groups, 4);
}

TEST(ModelDeepseek, BlockParameters) {
  const ModelConfig m = load_tiny().model;
  auto names_of = [&](int layer) {
    std::vector<std::string> names;
    for (const ParamSpec& spec : parameter_specs(m))
      if (spec.layer == layer) names.push_back(spec.name);
    return names;
  };
  const std::vector<std::string> attention = {"attn_norm.weight", "attention.q.weight", "attention.kv_a.weight",
                                              "attention.kv_a_norm.weight", "attention.kv_b.weight",
                                              "attention.o.weight"};
  std::vector<std::string> dense, moe;
  for (const std::string& a : attention) dense.push_back("layers.0." + a), moe.push_back("layers.1." + a);
  for (const char* f : {"mlp_norm.weight", "mlp.gate_up.weight", "mlp.down.weight"}) dense.push_back(std::string("layers.0.") + f);
  for (const char* f : {"mlp_norm.weight", "moe.router.weight", "moe.experts.gate_up", "moe.experts.down",
                        "moe.shared.gate_up.weight", "moe.shared.down.weight"})
    moe.push_back(std::string("layers.1.") + f);
  EXPECT_EQ(names_of(0), dense);
  EXPECT_EQ(names_of(1), moe);
  // Hugging Face names are DeepSeek's, the rotary rows of q and kv_a marked for reordering.
  for (const ParamSpec& spec : parameter_specs(m)) {
    if (spec.name == "layers.1.attention.q.weight") {
      ASSERT_EQ(spec.hf_tensors.size(), 1u);
      EXPECT_EQ(spec.hf_tensors[0].name, "model.layers.1.self_attn.q_proj.weight");
      EXPECT_EQ(spec.hf_tensors[0].rotary_rows.period, 32);
      EXPECT_EQ(spec.hf_tensors[0].rotary_rows.first, 16);
      EXPECT_EQ(spec.hf_tensors[0].rotary_rows.count, 16);
    }
    if (spec.name == "layers.1.attention.kv_a.weight") {
      EXPECT_EQ(spec.hf_tensors[0].name, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight");
      EXPECT_EQ(spec.hf_tensors[0].rotary_rows.period, 48);
      EXPECT_EQ(spec.hf_tensors[0].rotary_rows.first, 32);
    }
    if (spec.name == "layers.1.moe.experts.gate_up") EXPECT_EQ(spec.hf_tensors[1].name, "model.layers.1.mlp.experts.0.up_proj.weight");
    if (spec.name == "layers.1.moe.shared.down.weight")
      EXPECT_EQ(spec.hf_tensors[0].name, "model.layers.1.mlp.shared_experts.down_proj.weight");
    if (spec.name == "layers.0.mlp.gate_up.weight") EXPECT_EQ(spec.hf_tensors[0].name, "model.layers.0.mlp.gate_proj.weight");
  }
  // With a compressed query the projection is q_a, its norm and q_b.
  const ModelConfig q_lora = load_tiny({{"model.q_lora_rank", "24"}}).model;
  int64_t sum = 0;
  bool has_q_b = false;
  for (const ParamSpec& spec : parameter_specs(q_lora)) {
    sum += shape_numel(spec.shape);
    has_q_b |= spec.name == "layers.2.attention.q_b.weight";
  }
  EXPECT_TRUE(has_q_b);
  EXPECT_EQ(sum, q_lora.total_params());
}

Tensor tokens_of(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng.below(vocab));
  return t;
}

// The whole model's gradient (MLA with and without a compressed query, YaRN, shared experts,
// a dense first block; values of their own head dim, and of the queries' head dim, where the
// attention takes the uniform 4-D form) against central differences of its mean loss along a random
// unit direction in each block parameter. The step (0.01 in norm) is small enough that no
// token's routing changes; fp32 rounding of the loss bounds the quotient's noise (the
// absolute term).
TEST(ModelDeepseek, GradientMatchesFiniteDifferences) {
  for (auto [q_rank, v_dim] : {std::pair{"0", "16"}, std::pair{"24", "16"}, std::pair{"24", "32"}}) {
    SCOPED_TRACE(std::string("q_lora_rank ") + q_rank + ", v_head_dim " + v_dim);
    const ModelConfig m = load_tiny({{"model.q_lora_rank", q_rank}, {"model.v_head_dim", v_dim},
                                     {"model.rope_scaling.enabled", "true"},
                                     {"model.rope_scaling.type", "yarn"}, {"model.rope_scaling.factor", "4"},
                                     {"model.rope_scaling.original_max_position", "8"},
                                     {"model.rope_scaling.mscale", "1.0"}, {"model.rope_scaling.mscale_all_dim", "0.8"},
                                     {"model.init_std", "0.2"}})
                              .model;
    const int64_t batch = 2, seq = 12;
    const Tensor tokens = tokens_of(batch, seq, m.vocab_size, 5), targets = tokens_of(batch, seq, m.vocab_size, 6);
    FlatParameters params(m), grads(m);
    params.initialize(7);
    DecoderLM model(m, batch, seq);
    grads.discard();
    model.forward_backward(tokens, targets, params, grads, 1.0f / (batch * seq));
    const std::vector<ParamSpec>& specs = params.specs();
    Rng rng(9);
    int checked = 0;
    for (size_t s = 0; s < specs.size(); ++s) {
      if (specs[s].layer < 0) continue;
      const Tensor& t = params.tensors()[s];
      std::vector<float> keep(t.data<float>(), t.data<float>() + t.numel()), direction(keep.size());
      double norm = 0.0, analytic = 0.0;
      for (float& d : direction) {
        d = static_cast<float>(rng.normal());
        norm += static_cast<double>(d) * d;
      }
      for (size_t i = 0; i < keep.size(); ++i) {
        direction[i] = static_cast<float>(direction[i] / std::sqrt(norm));  // a unit step
        analytic += static_cast<double>(direction[i]) * grads.tensors()[s].data<float>()[i];
      }
      const double h = 1e-2;
      auto loss_at = [&](double step) {
        for (size_t i = 0; i < keep.size(); ++i) t.data<float>()[i] = static_cast<float>(keep[i] + step * direction[i]);
        return model.forward_loss(tokens, targets, params).mean();
      };
      const double numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
      loss_at(0.0);
      EXPECT_NEAR(numeric, analytic, 0.02 * std::abs(analytic) + 2e-4) << specs[s].name;
      ++checked;
    }
    EXPECT_GT(checked, 20);
  }
}

// A few steps of the CPU model on one batch: the loss falls under each checkpointing mode,
// the modes agree exactly, and the MoE blocks (not the dense first one) report expert loads.
TEST(ModelDeepseek, TrainsOnTheCpuUnderEveryCheckpointMode) {
  const ModelConfig m = load_tiny({{"model.q_lora_rank", "16"}, {"model.router_aux_loss_coef", "0.01"}}).model;
  const int64_t batch = 2, seq = 16;
  const Tensor tokens = tokens_of(batch, seq, m.vocab_size, 11);
  Tensor targets = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i)
    targets.data<int32_t>()[i] = static_cast<int32_t>((tokens.data<int32_t>()[i] + 1) % m.vocab_size);
  std::vector<std::vector<double>> curves;
  for (const ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
    FlatParameters params(m), grads(m);
    params.initialize(3);
    DecoderLM model(m, batch, seq, Device::CPU, DType::F32, mode);
    std::vector<double> losses;
    for (int step = 0; step < 30; ++step) {
      grads.discard();
      losses.push_back(model.forward_backward(tokens, targets, params, grads, 1.0f / (batch * seq)).mean());
      float* p = params.flat().data<float>();
      const float* g = grads.flat().data<float>();
      for (int64_t i = 0; i < params.flat().numel(); ++i) p[i] -= 1.0f * g[i];
    }
    EXPECT_LT(losses.back(), 0.8 * losses.front()) << "mode " << static_cast<int>(mode) << ": " << losses.back();
    const std::vector<std::vector<int64_t>> load = model.expert_load();
    ASSERT_EQ(load.size(), static_cast<size_t>(m.num_layers - m.first_dense_layers));
    for (const std::vector<int64_t>& block : load) {
      int64_t total = 0;
      for (int64_t n : block) total += n;
      EXPECT_EQ(total, batch * seq * m.num_experts_per_tok);
    }
    curves.push_back(losses);
  }
  EXPECT_EQ(curves[1], curves[0]);
  EXPECT_EQ(curves[2], curves[0]);
  const int64_t none = activation_bytes(m, batch, seq, DType::F32, ActivationCheckpoint::None),
                selective = activation_bytes(m, batch, seq, DType::F32, ActivationCheckpoint::Selective),
                full = activation_bytes(m, batch, seq, DType::F32, ActivationCheckpoint::Full);
  EXPECT_LT(selective, none);
  EXPECT_LT(full, selective);
}

}  // namespace
}  // namespace forge
