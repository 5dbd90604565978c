// LoRA on Mixture-of-Experts and Multi-head Latent Attention models (NOTE [LoRA on MoE and
// MLA models] in model/lora.h): which projections carry adapters (attention's, MLA's,
// DeepSeek's dense blocks' and shared experts', the router, and the routed experts' stacks
// when named or under all-linear, NOTE [LoRA on routed experts] in ops/lora_experts.h, with
// PEFT's shapes and names), an expert-parallel rank's slices of them, the config rules, the
// FLOP count, every adapter's gradient against central differences (the balancing loss and
// z-loss included; the experts' adapters dropless and padded to capacity), a frozen base and
// router that no step moves, and the same gradients under every checkpointing mode. The
// numbers are checked against PEFT and transformers in tests/python/test_lora_moe_vs_peft.py.
#include <gtest/gtest.h>

#include <cmath>

#include "cli/config.h"
#include "config_test_support.h"
#include "core/rng.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/memory_estimate.h"
#include "model_testing.h"
#include "ops_testing.h"

namespace forge {
namespace {

using config_test::expect_error;

ExperimentConfig load(const std::string& model, ConfigOverrides overrides = {}) {
  overrides.insert(overrides.begin(), {{"model.name", model}});
  return load_experiment("", overrides);
}

LoraConfig lora(const std::string& targets, int64_t rank = 3) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = 6.0;
  c.target_modules = targets;
  return c;
}

// A and B random (PEFT starts B at zero): every path of the adapters carries a gradient.
void randomize(LoraAdapters& adapters, uint64_t seed) {
  adapters.initialize(seed);
  Rng rng(seed + 1);
  for (size_t k = 0; k < adapters.targets().size(); ++k)
    for (size_t p = 0; p < adapters.targets()[k].parts.size(); ++p) {
      Tensor b = adapters.part_matrix(k, p, 'b');
      for (int64_t i = 0; i < b.numel(); ++i) b.data<float>()[i] = static_cast<float>(0.1 * rng.normal());
      adapters.set_part_matrix(k, p, 'b', b);
    }
}

std::vector<std::string> modules_of(const LoraTarget& t) {
  std::vector<std::string> modules;
  for (const LoraPart& p : t.parts) modules.push_back(p.module);
  return modules;
}

// The offset of adapters.gradients()[k] in gradient_flat(), in values.
int64_t gradient_offset(const LoraAdapters& adapters, size_t k) {
  return (static_cast<const char*>(adapters.gradients()[k].raw()) -
          static_cast<const char*>(adapters.gradient_flat().raw())) /
         4;
}

TEST(ModelLoraMoe, ConfigRulesNameTheKey) {
  EXPECT_EQ(load("debug-tiny-moe", {{"lora.rank", "8"}}).lora.rank, 8);
  EXPECT_EQ(load("debug-tiny-mla", {{"lora.rank", "8"}, {"lora.target_modules", "q_proj,kv_b_proj,gate"}}).lora.rank,
            8);
  // all-linear adapts the routed experts and the router too, as PEFT 0.21 on transformers 5.
  EXPECT_EQ(load("debug-tiny-moe", {{"lora.rank", "8"}, {"lora.target_modules", "all-linear"}}).lora.target_modules,
            "all-linear");
  EXPECT_EQ(load("debug-tiny-mla", {{"lora.rank", "8"}, {"lora.target_modules", "all-linear"}}).lora.rank, 8);
  EXPECT_EQ(load("debug-tiny-moe", {{"lora.rank", "8"}, {"lora.target_modules", "experts.down_proj"},
                                    {"lora.quantize_base", "nf4"}}).lora.quantize_base, "nf4");
  expect_error([] { load("debug-tiny-moe", {{"lora.rank", "8"}, {"lora.target_modules", "all-linear"},
                                            {"lora.dropout", "0.05"}}); },
               {"lora.target_modules = all-linear (command line) adapts the router and the routed experts with "
                "lora.dropout = 0.05 (command line)", "which take no dropout", "leaving out gate and experts.*"});
  expect_error([] { load("debug-tiny-mla", {{"lora.rank", "8"}, {"lora.target_modules", "q_proj,experts.gate_up_proj"},
                                            {"lora.dropout", "0.1"}}); },
               {"adapts the routed experts with lora.dropout = 0.1 (command line)"});
  expect_error([] { load("debug-tiny", {{"lora.rank", "8"}, {"lora.target_modules", "q_proj,experts.down_proj"}}); },
               {"names the routed experts' 'experts.down_proj', and this model has none"});
  // The experts' adapters over frozen FP8 experts (NOTE [FP8 frozen routed experts]).
  EXPECT_EQ(load("debug-tiny-moe", {{"lora.rank", "8"}, {"lora.target_modules", "experts.gate_up_proj"},
                                    {"precision.fp8", "tensorwise"}}).precision.fp8, "tensorwise");
  // QLoRA quantizes the routed experts too (NOTE [NF4 expert stacks]; tests/cpu/test_model_qlora.cpp).
  EXPECT_EQ(load("debug-tiny-moe", {{"lora.rank", "8"}, {"lora.quantize_base", "nf4"}}).lora.quantize_base, "nf4");
  // QLoRA on MLA: the rotary rows quantized in the published order (NOTE [NF4 stored row order]).
  EXPECT_EQ(load("debug-tiny-mla", {{"lora.rank", "8"}, {"lora.quantize_base", "nf4"}}).lora.quantize_base, "nf4");
  expect_error([] { load("debug-tiny-mla", {{"lora.rank", "8"}, {"model.router_score_function", "sigmoid"},
                                            {"model.router_bias_update_rate", "0.001"}}); },
               {"model.router_bias_update_rate = 0.001 (command line) moves the routing biases", "frozen base"});
  expect_error([] { load("debug-tiny-moe", {{"lora.rank", "8"}, {"lora.target_modules", "q_proj,gate"},
                                            {"lora.dropout", "0.1"}}); },
               {"adapts the router with lora.dropout = 0.1 (command line)", "takes no dropout"});
  expect_error([] { load("debug-tiny", {{"lora.rank", "8"}, {"lora.target_modules", "q_proj,gate"}}); },
               {"names the router 'gate', and this model has none"});
  // NOTE [LoRA under expert parallelism]: LoRA (the experts' adapters too) and QLoRA (NOTE
  // [NF4 expert stacks under expert parallelism] in model/nf4_base.h).
  EXPECT_EQ(load("debug-tiny-moe", {{"lora.rank", "8"}, {"lora.target_modules", "all-linear"},
                                    {"parallelism.data_parallel_shard_degree", "2"},
                                    {"parallelism.expert_parallel_degree", "2"}}).parallelism.expert_parallel_degree,
            2);
  EXPECT_EQ(load("debug-tiny-moe", {{"lora.rank", "8"}, {"lora.quantize_base", "nf4"},
                                    {"lora.target_modules", "all-linear"},
                                    {"parallelism.data_parallel_shard_degree", "2"},
                                    {"parallelism.expert_parallel_degree", "2"}}).lora.quantize_base,
            "nf4");
  // The adapters refuse the same outside a config (forge eval --adapter, the tools).
  expect_error([] { LoraAdapters(load("debug-tiny").model, lora("experts.gate_up_proj"), Device::CPU, 4); },
               {"names the routed experts' 'experts.gate_up_proj', and this model has none"});
}

// Mixtral-style: attention's fused qkv and o, the router (whose PEFT name may also be
// transformers 5's mlp.gate); the experts' stacks never.
TEST(ModelLoraMoe, TargetsAreTheTwoDimensionalProjections) {
  const ModelConfig moe = load("debug-tiny-moe").model;
  std::vector<LoraTarget> targets = lora_targets(moe, lora_target_modules("q_proj,v_proj,o_proj,gate"));
  ASSERT_EQ(targets.size(), 3u * static_cast<size_t>(moe.num_layers));
  EXPECT_EQ(modules_of(targets[0]), (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(targets[2].name, "layers.0.moe.router.weight");
  EXPECT_EQ(targets[2].out, moe.num_experts);
  EXPECT_EQ(peft_tensor_name(targets[2].parts[0], 'a'),
            "base_model.model.model.layers.0.block_sparse_moe.gate.lora_A.weight");
  EXPECT_EQ(targets[2].parts[0].hf_alias_prefix, "model.layers.0.mlp.gate");
  EXPECT_EQ(lora_model_modules(moe), (std::vector<std::string>{"qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate", "experts.gate_up_proj", "experts.down_proj"}));

  // DeepSeek-shaped with a compressed query: MLA's projections, the dense block's and the
  // shared experts' SwiGLU, the router; kv_a's rotary rows marked for PEFT's order.
  const ModelConfig mla = load("debug-tiny-mla", {{"model.q_lora_rank", "16"}}).model;
  targets = lora_targets(mla, lora_target_modules("q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,"
                                                  "up_proj,down_proj,gate"));
  std::vector<std::string> names;
  for (const LoraTarget& t : targets)
    if (t.layer < 2) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "layers.0.attention.q_a.weight", "layers.0.attention.q_b.weight",
                       "layers.0.attention.kv_a.weight", "layers.0.attention.kv_b.weight",
                       "layers.0.attention.o.weight", "layers.0.mlp.gate_up.weight", "layers.0.mlp.down.weight",
                       "layers.1.attention.q_a.weight", "layers.1.attention.q_b.weight",
                       "layers.1.attention.kv_a.weight", "layers.1.attention.kv_b.weight",
                       "layers.1.attention.o.weight", "layers.1.moe.router.weight",
                       "layers.1.moe.shared.gate_up.weight", "layers.1.moe.shared.down.weight"}));
  for (const LoraTarget& t : targets) {
    if (t.name == "layers.1.moe.shared.gate_up.weight")
      EXPECT_EQ(t.parts[1].hf_prefix, "model.layers.1.mlp.shared_experts.up_proj");
    if (t.name == "layers.1.attention.kv_a.weight") {
      EXPECT_EQ(t.parts[0].module, "kv_a_proj_with_mqa");
      EXPECT_EQ(t.out, mla.kv_lora_rank + mla.qk_rope_head_dim);
      EXPECT_EQ(t.parts[0].rotary_rows.first, mla.kv_lora_rank);
    }
    if (t.name == "layers.1.moe.router.weight") EXPECT_EQ(t.parts[0].hf_prefix, "model.layers.1.mlp.gate");
  }
}

// NOTE [LoRA on routed experts]: the experts' stacks by transformers 5's parameter names,
// PEFT's ParamWrapper shapes (A [E r, in]; B [out, r E] in PEFT, [E out, r] in forge) and
// tensor names (gate_up_proj the inner wrapper, experts.base_layer, when both are adapted);
// all-linear on a MoE model as PEFT 0.21 on transformers 5: attention, router, experts.
TEST(ModelLoraMoe, ExpertTargetsArePeftsParamWrappers) {
  const ModelConfig moe = load("debug-tiny-moe").model;
  const int64_t e = moe.num_experts, f = moe.resolved_moe_ffn(), h = moe.hidden_size;
  std::vector<LoraTarget> targets = lora_targets(moe, lora_target_modules("experts.gate_up_proj,experts.down_proj"));
  ASSERT_EQ(targets.size(), 2u * static_cast<size_t>(moe.num_layers));
  EXPECT_EQ(targets[0].name, "layers.0.moe.experts.gate_up");
  EXPECT_EQ(targets[0].experts, e);
  EXPECT_EQ(targets[0].in, h);
  EXPECT_EQ(targets[0].out, 2 * f);
  EXPECT_EQ(targets[1].in, f);
  EXPECT_EQ(targets[1].out, h);
  EXPECT_EQ(peft_tensor_name(targets[0].parts[0], 'a'),
            "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight");
  EXPECT_EQ(peft_tensor_name(targets[1].parts[0], 'b'), "base_model.model.model.layers.0.mlp.experts.lora_B.weight");
  targets = lora_targets(moe, lora_target_modules("experts.gate_up_proj"));
  EXPECT_EQ(peft_tensor_name(targets[0].parts[0], 'a'), "base_model.model.model.layers.0.mlp.experts.lora_A.weight");

  LoraAdapters adapters(moe, lora("experts.gate_up_proj,experts.down_proj,q_proj", 2), Device::CPU, 8);
  randomize(adapters, 4);
  ASSERT_EQ(adapters.targets()[1].name, "layers.0.moe.experts.gate_up");  // after layer 0's qkv
  EXPECT_EQ(adapters.masters()[2].shape(), (Shape{e * 2, h}));      // gate_up's A
  EXPECT_EQ(adapters.masters()[3].shape(), (Shape{e * 2 * f, 2}));  // gate_up's B, expert-major
  EXPECT_EQ(adapters.trainable_params(),
            lora_sizes(moe, lora("experts.gate_up_proj,experts.down_proj,q_proj", 2), 8).trainable);
  EXPECT_EQ(LoraAdapters(moe, lora("experts.gate_up_proj,experts.down_proj", 2), Device::CPU, 8).trainable_params(),
            moe.num_layers * e * 2 * ((h + 2 * f) + (f + h)));
  // PEFT's B [out, r E]: column c E + e is expert e's B column c.
  const Tensor peft_b = adapters.part_matrix(1, 0, 'b');
  ASSERT_EQ(peft_b.shape(), (Shape{2 * f, 2 * e}));
  const Tensor forge_b = adapters.masters()[3].clone();
  for (int64_t x = 0; x < e; ++x)
    for (int64_t o = 0; o < 2 * f; ++o)
      for (int64_t c = 0; c < 2; ++c)
        ASSERT_EQ(peft_b.data<float>()[o * 2 * e + c * e + x], forge_b.data<float>()[(x * 2 * f + o) * 2 + c]);
  adapters.masters()[3].fill_zero();
  adapters.set_part_matrix(1, 0, 'b', peft_b);
  EXPECT_TRUE(testing::bitwise_equal(adapters.masters()[3], forge_b));

  // all-linear: gate_up_proj at twice the rank (and alpha), as PEFT 0.21's rank_pattern.
  LoraConfig all = lora("all-linear", 2);
  LoraAdapters doubled(moe, all, Device::CPU, 8);
  for (size_t k = 0; k < doubled.targets().size(); ++k) {
    const LoraTarget& t = doubled.targets()[k];
    EXPECT_EQ(t.rank_multiple, t.name.ends_with("experts.gate_up") ? 2 : 1) << t.name;
    if (t.experts > 0) EXPECT_EQ(doubled.masters()[2 * k].shape(), (Shape{e * 2 * t.rank_multiple, t.in})) << t.name;
  }
  EXPECT_EQ(doubled.trainable_params(), lora_sizes(moe, all, 8).trainable);
  // NOTE [LoRA FLOPs]: a token runs the adapters of its top-k experts only.
  const LoraSizes down = lora_sizes(moe, lora("experts.down_proj", 2), 1);
  EXPECT_DOUBLE_EQ(down.active_trainable,
                   static_cast<double>(down.trainable) * static_cast<double>(moe.num_experts_per_tok) / e);

  // all-linear: on DeepSeek's shape without the dense block's and shared experts' SwiGLU.
  const ModelConfig mla = load("debug-tiny-mla").model;
  EXPECT_EQ(lora_modules_for_model(mla, "all-linear"),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                                      "kv_a_proj_with_mqa", "kv_b_proj", "gate", "experts.gate_up_proj",
                                      "experts.down_proj"}));
  for (const LoraTarget& t : lora_targets(mla, lora_modules_for_model(mla, "all-linear")))
    EXPECT_TRUE(t.name.find(".mlp.") == std::string::npos && t.name.find(".shared.") == std::string::npos) << t.name;
  EXPECT_EQ(lora_modules_for_model(load("debug-tiny").model, "all-linear"), kLoraModules);  // dense: every module
}

// NOTE [LoRA under expert parallelism]: rank 1 of 2 hands its blocks its local experts'
// slices of the whole adapters, and discard() zeroes the other experts' gradient rows.
TEST(ModelLoraMoe, ExpertParallelRankHandsOutItsExpertsSlices) {
  const ModelConfig moe = load("debug-tiny-moe").model;
  const int64_t e = moe.num_experts, h = moe.hidden_size, f = moe.resolved_moe_ffn(), r = 2;
  LoraAdapters adapters(moe, lora("experts.gate_up_proj,experts.down_proj", r), Device::CPU, 8);
  FlatParameters base(moe);
  adapters.set_base(base);
  // The experts' workspace takes P times a rank's rows, which the memory estimate counts.
  EXPECT_EQ(adapters.workspace_values(),
            lora_sizes(moe, lora("experts.gate_up_proj,experts.down_proj", r), 8).workspace);
  adapters.set_expert_parallel(1, 2);
  EXPECT_EQ(adapters.workspace_values(),
            lora_sizes(moe, lora("experts.gate_up_proj,experts.down_proj", r), 8, 2).workspace);
  ASSERT_EQ(adapters.targets()[0].name, "layers.0.moe.experts.gate_up");
  const LoraExpertAdapter* gate_up = adapters.layer_grads(0).params.at(adapters.targets()[0].param).experts_lora;
  ASSERT_NE(gate_up, nullptr);
  EXPECT_EQ(gate_up->experts, e / 2);
  EXPECT_EQ(gate_up->a.shape(), (Shape{e / 2 * r, h}));
  EXPECT_EQ(gate_up->a.raw(), adapters.masters()[0].narrow(e / 2 * r, e * r).raw());
  EXPECT_EQ(gate_up->b.raw(), adapters.masters()[1].narrow(e / 2 * 2 * f, e * 2 * f).raw());
  EXPECT_EQ(adapters.layer(0).params.at(adapters.targets()[0].param).experts_lora, gate_up);
  for (size_t k = 0; k < 2; ++k) {
    const Tensor& g = adapters.gradients()[k];
    for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = 1.0f;
  }
  adapters.discard();
  const Tensor& ga = adapters.gradients()[0];
  for (int64_t i = 0; i < ga.numel(); ++i)
    ASSERT_EQ(ga.data<float>()[i], i < e / 2 * r * h ? 0.0f : 1.0f) << i;  // experts 0..E/2-1: another rank's
}

// With the 2-D adapters too (all-linear), over 4 expert-parallel ranks: the workspaces and
// the memory estimate's activations (NOTE [LoRA under expert parallelism]).
TEST(ModelLoraMoe, ExpertParallelWorkspaceIsWhatTheEstimateCounts) {
  const ModelConfig moe = load("debug-tiny-moe").model;
  const LoraConfig all = lora("all-linear", 4);
  LoraAdapters adapters(moe, all, Device::CPU, 2 * 16);
  FlatParameters base(moe);
  adapters.set_base(base);
  adapters.set_expert_parallel(3, 4);
  EXPECT_EQ(adapters.workspace_values(), lora_sizes(moe, all, 2 * 16, 4).workspace);
  MemoryPlan plan;
  plan.micro_batch = 2;
  plan.seq_len = 16;
  plan.lora = all;
  const double one = estimate_memory(moe, plan).activations;
  plan.fsdp = true;
  plan.shard_ranks = plan.expert_parallel = 4;
  const double four = estimate_memory(moe, plan).activations;
  // The arena's received rows grow with P too; the adapters' share is the experts' workspace.
  auto arena = [&](int64_t p) {
    return static_cast<double>(activation_bytes(moe, 2, 16, DType::F32, ActivationCheckpoint::None, p));
  };
  EXPECT_EQ(four - one - (arena(4) - arena(1)),
            static_cast<double>(lora_sizes(moe, all, 32, 4).workspace - lora_sizes(moe, all, 32).workspace) * 4);
}

// NOTE [LoRA FLOPs]: a MoE token runs its experts only, so the frozen work counts the active
// parameters, as full training's count does; attention is full training's (MLA's width).
TEST(ModelLoraMoe, FlopsCountTheActiveParameters) {
  for (const char* name : {"debug-tiny-moe", "debug-tiny-mla"}) {
    const ModelConfig m = load(name).model;
    const LoraConfig c = lora("q_proj,o_proj,gate");
    const double frozen = static_cast<double>(m.active_params() - m.embedding_params());
    const double adapters = static_cast<double>(lora_sizes(m, c, 1).trainable);
    EXPECT_DOUBLE_EQ(lora_sizes(m, c, 1).active_trainable, adapters) << name;
    const double width = m.mla() ? static_cast<double>(m.num_heads * (m.qk_head_dim() + m.v_head_dim)) / 2.0
                                 : static_cast<double>(m.hidden_size);
    const double attention = 6.0 * static_cast<double>(m.num_layers) * width * 64.0;
    EXPECT_DOUBLE_EQ(training_flops_per_token(m, c, 64), 4.0 * frozen + 6.0 * adapters + attention) << name;
    EXPECT_LT(training_flops_per_token(m, c, 64), m.flops_per_token(64)) << name;
  }
}

struct Case {
  std::string name, model, targets;
  ConfigOverrides overrides;
};

std::vector<Case> cases() {
  return {{"mixtral", "debug-tiny-moe", "q_proj,k_proj,v_proj,o_proj,gate",
           {{"model.router_aux_loss_coef", "0.3"}, {"model.router_z_loss_coef", "0.01"}}},
          {"deepseek_v2", "debug-tiny-mla", "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,up_proj,down_proj,gate",
           {{"model.router_aux_loss_coef", "0.1"}, {"model.router_aux_loss_type", "sequence"}}},
          {"deepseek_v3", "debug-tiny-mla", "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,up_proj,gate",
           {{"model.q_lora_rank", "16"}, {"model.router_score_function", "sigmoid"}, {"model.router_num_groups", "4"},
            {"model.router_topk_groups", "2"}, {"model.router_normalize_topk", "true"},
            {"model.router_z_loss_coef", "0.02"}}},
          // NOTE [LoRA on routed experts]: the experts' stacks adapted, dropless and padded to
          // capacity (the batched expert GEMMs), and all-linear on DeepSeek-V3's shape.
          {"mixtral_experts", "debug-tiny-moe", "q_proj,gate,experts.gate_up_proj,experts.down_proj",
           {{"model.router_aux_loss_coef", "0.3"}}},
          {"mixtral_experts_padded", "debug-tiny-moe", "experts.gate_up_proj,experts.down_proj",
           {{"model.moe_capacity_factor", "4.0"}, {"model.moe_pad_to_capacity", "true"}}},
          {"deepseek_v3_all_linear", "debug-tiny-mla", "all-linear",
           {{"model.q_lora_rank", "16"}, {"model.router_score_function", "sigmoid"}, {"model.router_num_groups", "4"},
            {"model.router_topk_groups", "2"}, {"model.router_normalize_topk", "true"}}}};
}

ModelConfig case_model(const Case& c) {
  ConfigOverrides o = c.overrides;
  o.push_back({"model.init_std", "0.2"});
  return load(c.model, o).model;
}

// Each adapter tensor's gradient against central differences of the training loss (the
// balancing loss and z-loss included) along a unit direction half the gradient's, half
// random; the step (0.001) moves no token's routing (0.01 can, with these adapters).
TEST(ModelLoraMoe, AdapterGradientsMatchFiniteDifferences) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const ModelConfig m = case_model(c);
    const int64_t batch = 2, seq = 12;
    const Tensor tokens = testing::random_tokens(batch, seq, m.vocab_size, 5);
    const Tensor targets = testing::random_tokens(batch, seq, m.vocab_size, 6);
    FlatParameters base(m);
    base.initialize(7);
    LoraAdapters adapters(m, lora(c.targets), Device::CPU, batch * seq);
    randomize(adapters, 3);
    adapters.set_base(base);
    DecoderLM model(m, batch, seq);
    auto loss = [&] {
      adapters.discard();
      return model.forward_backward(tokens, targets, adapters, adapters, 1.0f / (batch * seq)).mean();
    };
    loss();
    const Tensor analytic_flat = adapters.gradient_flat().clone();
    Rng rng(9);
    for (size_t k = 0; k < adapters.masters().size(); ++k) {
      const Tensor& t = adapters.masters()[k];
      const float* grad = analytic_flat.data<float>() + gradient_offset(adapters, k);
      std::vector<float> keep(t.data<float>(), t.data<float>() + t.numel()), direction(keep.size());
      double grad_norm = 0.0, norm = 0.0, analytic = 0.0;
      for (size_t i = 0; i < keep.size(); ++i) grad_norm += static_cast<double>(grad[i]) * grad[i];
      grad_norm = std::sqrt(grad_norm);
      ASSERT_GT(grad_norm, 1e-3) << adapters.master_names()[k] << " has no gradient to check";
      for (size_t i = 0; i < keep.size(); ++i) {
        // B's entries outside each part's rows are not parameters: they stay zero.
        direction[i] = k % 2 == 1 && keep[i] == 0.0f
                           ? 0.0f
                           : static_cast<float>(grad[i] / grad_norm + rng.normal() / std::sqrt(double(keep.size())));
        norm += static_cast<double>(direction[i]) * direction[i];
      }
      for (size_t i = 0; i < keep.size(); ++i) {
        direction[i] = static_cast<float>(direction[i] / std::sqrt(norm));
        analytic += static_cast<double>(direction[i]) * grad[i];
      }
      const double h = 1e-3;
      auto loss_at = [&](double step) {
        for (size_t i = 0; i < keep.size(); ++i) t.data<float>()[i] = static_cast<float>(keep[i] + step * direction[i]);
        return loss();
      };
      const double numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
      loss_at(0.0);
      EXPECT_NEAR(numeric, analytic, 0.02 * std::abs(analytic) + 2e-4)
          << adapters.master_names()[k] << " (analytic " << analytic << ")";
    }
  }
}

// The base (router and routed experts included) is frozen: the gradient sink hands out no
// tensor for its projections and stacks, steps move only the adapters, and the loss falls.
// Every checkpointing mode gives bitwise the same adapter gradients and losses (MLA's kv_a
// row views and the MoE recomputation included).
TEST(ModelLoraMoe, TheBaseStaysFrozenUnderEveryCheckpointMode) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const ModelConfig m = case_model(c);
    const int64_t batch = 2, seq = 12;
    const Tensor tokens = testing::random_tokens(batch, seq, m.vocab_size, 11);
    Tensor targets = Tensor::empty({batch, seq}, DType::I32);
    for (int64_t i = 0; i < batch * seq; ++i)
      targets.data<int32_t>()[i] = static_cast<int32_t>((tokens.data<int32_t>()[i] + 1) % m.vocab_size);
    FlatParameters base(m);
    base.initialize(4);
    const Tensor before = base.flat().clone();
    const std::vector<ParamSpec> specs = parameter_specs(m);
    std::vector<Tensor> first_grads;
    std::vector<std::vector<double>> curves;
    for (const ActivationCheckpoint mode :
         {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
      LoraAdapters adapters(m, lora(c.targets, 4), Device::CPU, batch * seq);
      randomize(adapters, 2);
      adapters.set_base(base);
      std::vector<size_t> entry(static_cast<size_t>(m.num_layers), 0);
      for (const ParamSpec& spec : specs) {
        if (spec.layer < 0) continue;
        const LinearWeight& g = adapters.layer_grads(spec.layer).params.at(entry[static_cast<size_t>(spec.layer)]++);
        if (spec.shape.size() >= 2) EXPECT_FALSE(g.weight.defined()) << spec.name << " has a gradient";
        if (spec.shape.size() == 3) EXPECT_EQ(g.lora, nullptr) << spec.name << " has a 2-D adapter";
        const bool experts = c.targets == "all-linear" || c.targets.find("experts.") != std::string::npos;
        if (spec.shape.size() == 3) EXPECT_EQ(g.experts_lora != nullptr, experts) << spec.name;
      }
      DecoderLM model(m, batch, seq, Device::CPU, DType::F32, mode);
      std::vector<double> losses;
      for (int step = 0; step < 12; ++step) {
        adapters.discard();
        losses.push_back(model.forward_backward(tokens, targets, adapters, adapters, 1.0f / (batch * seq)).mean());
        if (step == 0) first_grads.push_back(adapters.gradient_flat().clone());
        float* p = adapters.master_flat().data<float>();
        const float* g = adapters.gradient_flat().data<float>();
        for (int64_t i = 0; i < adapters.master_flat().numel(); ++i) p[i] -= 0.5f * g[i];
      }
      EXPECT_LT(losses.back(), 0.95 * losses.front()) << "mode " << static_cast<int>(mode);
      curves.push_back(losses);
      EXPECT_TRUE(testing::bitwise_equal(base.flat(), before)) << "the base moved";
    }
    EXPECT_TRUE(testing::bitwise_equal(first_grads[1], first_grads[0]));
    EXPECT_TRUE(testing::bitwise_equal(first_grads[2], first_grads[0]));
    EXPECT_EQ(curves[1], curves[0]);
    EXPECT_EQ(curves[2], curves[0]);
  }
}

}  // namespace
}  // namespace forge
