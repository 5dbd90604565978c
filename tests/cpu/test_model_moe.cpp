// Mixture-of-Experts models (model.num_experts, NOTE [MoE feed-forward] in
// model/moe_feed_forward.h): the parameter and FLOP accounting against Mixtral 8x7B's
// published sizes, the config rules, what a MoE run refuses (each naming the key to change),
// the block's parameters, and a small MoE trained on the CPU. The model's numbers are
// checked against transformers' Mixtral in tests/python/test_model_vs_torch.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "ckpt/checkpoint_metadata.h"
#include "cli/config.h"
#include "core/rng.h"
#include "config_test_support.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "ops/moe.h"

namespace forge {
namespace {

using config_test::expect_error;

ExperimentConfig load(const ConfigOverrides& overrides) { return load_experiment("", overrides); }

ExperimentConfig load_moe(ConfigOverrides overrides = {}) {
  overrides.insert(overrides.begin(), {{"model.name", "debug-tiny-moe"}});
  return load(overrides);
}

TEST(ModelMoe, MixtralCountsAreThePublishedOnes) {
  const ModelConfig m = load({{"model.name", "mixtral-8x7b"}, {"training.seq_len", "4096"}}).model;
  EXPECT_EQ(m.total_params(), 46702792704);   // 46.7 B
  EXPECT_EQ(m.active_params(), 12879925248);  // 12.9 B per token
  // FLOPs per token by active parameters: 6 (active - embedding) + 6 layers hidden seq.
  EXPECT_DOUBLE_EQ(m.flops_per_token(4096), 6.0 * (12879925248.0 - 32000.0 * 4096.0) + 6.0 * 32 * 4096 * 4096);
  const ModelConfig big = load({{"model.name", "mixtral-8x22b"}}).model;
  EXPECT_EQ(big.total_params(), 140630071296);   // 141 B as announced
  EXPECT_EQ(big.active_params(), 39161468928);   // 39 B per token
  const ModelConfig dense = load({}).model;
  EXPECT_EQ(dense.active_params(), dense.total_params());
}

TEST(ModelMoe, ConfigRules) {
  EXPECT_EQ(load_moe().model.num_experts_per_tok, 2);
  expect_error([] { load_moe({{"model.num_experts_per_tok", "5"}}); },
               {"model.num_experts_per_tok = 5 (command line) must be between 1 and model.num_experts = 4"});
  expect_error([] { load_moe({{"model.num_experts_per_tok", "0"}}); }, {"must be between 1 and model.num_experts"});
  expect_error([] { load({{"model.num_experts_per_tok", "2"}}); },
               {"model.num_experts_per_tok = 2 (command line) needs model.num_experts > 0"});
  expect_error([] { load({{"model.num_experts", "-1"}}); }, {"model.num_experts"});
}

TEST(ModelMoe, WhatIsNotBuiltIsRefusedNamingTheKey) {
  expect_error([] { load_moe({{"training.device", "cuda"}}); },
               {"model.num_experts = 4", "must be a multiple of 8 and at most 1024 on CUDA"});
  EXPECT_EQ(load_moe({{"parallelism.data_parallel_shard_degree", "2"}}).parallelism.data_parallel_shard_degree, 2);
  EXPECT_EQ(load_moe({{"parallelism.data_parallel_shard_degree", "2"}, {"model.router_score_function", "sigmoid"},
                      {"model.router_bias_update_rate", "0.001"}})
                .model.router_bias_update_rate,
            0.001);  // NOTE [Routing bias update]: each rank moves its chunk of the biases
  EXPECT_EQ(load_moe({{"precision.fp8", "tensorwise"}}).precision.fp8, "tensorwise");  // tests/cpu/test_model_fp8_moe.cpp
  EXPECT_EQ(load_moe({{"lora.rank", "8"}}).lora.rank, 8);  // LoRA: tests/cpu/test_model_lora_moe.cpp
  EXPECT_EQ(load_moe({{"lora.rank", "8"}, {"lora.quantize_base", "nf4"}}).lora.quantize_base, "nf4");  // QLoRA
  EXPECT_TRUE(load_moe({{"checkpoint.last_save_in_hf", "true"}}).checkpoint.last_save_in_hf);  // MixtralForCausalLM
}

// NOTE [MoE balancing loss]: the training loss is the cross-entropy (what evaluation
// reports) plus the coefficient times L_aux, which lies between 0 and E (every token routed
// to the same experts); a dense model refuses the key. The gradient is checked against transformers
// in tests/python/test_model_vs_torch.py.
TEST(ModelMoe, BalancingLossJoinsTheTrainingLossOnly) {
  const ModelConfig m = load_moe({{"model.router_aux_loss_coef", "0.5"}}).model;
  const int64_t batch = 1, seq = 8;
  Tensor tokens = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < seq; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((5 * i + 3) % m.vocab_size);
  FlatParameters params(m), grads(m);
  params.initialize(4);
  DecoderLM model(m, batch, seq);
  const double eval = model.forward_loss(tokens, tokens, params).mean();
  const double train = model.forward_backward(tokens, tokens, params, grads, 1.0f / seq).mean();
  EXPECT_GT(train - eval, 0.0);
  EXPECT_LE(train - eval, 0.5 * 4 + 1e-9);
  expect_error([] { load({{"model.router_aux_loss_coef", "0.1"}}); },
               {"model.router_aux_loss_coef = 0.1 (command line) needs model.num_experts > 0"});
}

TEST(ModelMoe, LossKeysRules) {
  EXPECT_EQ(load_moe().model.router_aux_loss_type, "pooled");
  EXPECT_EQ(load_moe().model.router_z_loss_coef, 0.0);
  EXPECT_EQ(load_moe({{"model.router_aux_loss_coef", "0.01"}, {"model.router_aux_loss_type", "sequence"}})
                .model.router_aux_loss_type,
            "sequence");
  EXPECT_EQ(load_moe({{"model.router_z_loss_coef", "0.001"}}).model.router_z_loss_coef, 0.001);
  EXPECT_EQ(load_moe({{"model.router_aux_loss_coef", "0.01"}, {"model.router_aux_loss_type", "global"}})
                .model.router_aux_loss_type,
            "global");
  expect_error([] { load_moe({{"model.router_aux_loss_type", "global_aux_loss"}}); },
               {"model.router_aux_loss_type"});
  expect_error([] { load_moe({{"model.router_aux_loss_type", "global"}}); },
               {"model.router_aux_loss_type = global (command line) needs model.router_aux_loss_coef > 0"});
  expect_error([] { load_moe({{"model.router_z_loss_coef", "-1"}}); }, {"model.router_z_loss_coef"});
  expect_error([] { load_moe({{"model.router_aux_loss_type", "per_layer"}}); },
               {"model.router_aux_loss_type = per_layer (command line) needs model.router_aux_loss_coef > 0"});
  expect_error([] { load({{"model.router_z_loss_coef", "0.001"}}); },
               {"model.router_z_loss_coef = 0.001 (command line) needs model.num_experts > 0"});
  expect_error([] { load({{"model.router_aux_loss_type", "sequence"}}); },
               {"model.router_aux_loss_type = sequence (command line) needs model.num_experts > 0"});
  EXPECT_EQ(load_moe({{"model.router_score_function", "sigmoid"}, {"model.router_z_loss_coef", "0.001"}})
                .model.router_z_loss_coef,
            0.001);  // Megatron's z-loss takes the logits whatever the score function
  expect_error(
      [] {
        load_moe({{"model.router_score_function", "sigmoid"}, {"model.router_aux_loss_coef", "0.01"},
                  {"model.router_aux_loss_type", "sequence"}});
      },
      {"the Switch balancing loss is for softmax routing"});
  expect_error(
      [] {
        load_moe({{"model.router_score_function", "sigmoid"}, {"model.router_aux_loss_coef", "0.01"},
                  {"model.router_aux_loss_type", "global"}});
      },
      {"the Switch balancing loss is for softmax routing"});
}

// The per-layer and sequence-wise balancing losses and the z-loss (NOTE [MoE balancing
// loss]) join the training loss, not evaluation; their gradient through the whole model
// (every layer's router, the layers below through the routers' inputs) is the derivative
// of train - eval (the losses alone: the forward is the same) along a random direction of
// all parameters, by central differences. Megatron's values and the layer's gradients are
// checked in tests/python/test_moe_vs_megatron.py.
TEST(ModelMoe, LossesJoinTheTrainingLossAndTheirGradientIsTheirs) {
  const int64_t batch = 2, seq = 8;
  Tensor tokens = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((7 * i + 3) % 32);
  const std::vector<ConfigOverrides> cases = {
      {{"model.router_aux_loss_coef", "0.5"}, {"model.router_aux_loss_type", "per_layer"}},
      {{"model.router_aux_loss_coef", "0.5"}, {"model.router_aux_loss_type", "sequence"}},
      {{"model.router_z_loss_coef", "0.2"}},
      {{"model.router_aux_loss_coef", "0.3"}, {"model.router_aux_loss_type", "sequence"},
       {"model.router_z_loss_coef", "0.1"}},
      {{"model.router_z_loss_coef", "0.2"}, {"model.router_score_function", "sigmoid"},
       {"model.router_scaling_factor", "2.5"}},
  };
  for (const ConfigOverrides& c : cases) {
    ConfigOverrides overrides = c, plain_overrides;
    overrides.push_back({"model.init_std", "0.3"});  // routers far from uniform
    for (const auto& [key, value] : overrides)  // the same model without the losses
      if (!key.starts_with("model.router_aux") && !key.starts_with("model.router_z")) plain_overrides.push_back({key, value});
    const ModelConfig m = load_moe(overrides).model, plain = load_moe(plain_overrides).model;
    FlatParameters params(m), grads(m), plain_grads(m);
    params.initialize(5);
    DecoderLM model(m, batch, seq), plain_model(plain, batch, seq);
    const float scale = 1.0f / static_cast<float>(batch * seq);
    const double train = model.forward_backward(tokens, tokens, params, grads, scale).mean();
    const double eval = model.forward_loss(tokens, tokens, params).mean();
    EXPECT_GT(train - eval, 1e-3) << c.front().first;
    EXPECT_NEAR(plain_model.forward_backward(tokens, tokens, params, plain_grads, scale).mean(), eval, 1e-6);
    // d(train - eval)/dt along a direction u: (grads - plain_grads) . u.
    Rng rng(9);
    const int64_t n = params.flat().numel();
    std::vector<float> u(static_cast<size_t>(n));
    double norm = 0.0;
    for (float& v : u) norm += (v = static_cast<float>(rng.normal())) * static_cast<double>(v);
    for (float& v : u) v = static_cast<float>(v / std::sqrt(norm));  // a unit step: no top-k choice flips
    double analytic = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      analytic += static_cast<double>(grads.flat().data<float>()[i] - plain_grads.flat().data<float>()[i]) *
                  u[static_cast<size_t>(i)];
    }
    auto losses_at = [&](float step) {
      FlatParameters moved(m);
      std::copy(params.flat().data<float>(), params.flat().data<float>() + n, moved.flat().data<float>());
      for (int64_t i = 0; i < n; ++i) moved.flat().data<float>()[i] += step * u[static_cast<size_t>(i)];
      FlatParameters scratch(m);
      return model.forward_backward(tokens, tokens, moved, scratch, scale).mean() -
             model.forward_loss(tokens, tokens, moved).mean();
    };
    const float eps = 2e-3f;
    const double numeric = (losses_at(eps) - losses_at(-eps)) / (2.0 * eps);
    EXPECT_GT(std::abs(analytic), 1e-4);
    EXPECT_NEAR(numeric, analytic, 0.02 * std::abs(analytic) + 1e-6) << c.front().first;
  }
}

// The sequence-wise loss of a micro-batch whose rows are the same sequence is the per-layer
// loss (each row's f and P are the whole micro-batch's).
TEST(ModelMoe, SequenceLossOfEqualRowsIsThePerLayerLoss) {
  const int64_t batch = 3, seq = 8;
  Tensor tokens = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((5 * (i % seq) + 1) % 32);
  double losses[2];
  for (int j = 0; j < 2; ++j) {
    const ModelConfig m = load_moe({{"model.router_aux_loss_coef", "1"}, {"model.init_std", "0.3"},
                                    {"model.router_aux_loss_type", j == 0 ? "sequence" : "per_layer"}})
                              .model;
    FlatParameters params(m), grads(m);
    params.initialize(6);
    DecoderLM model(m, batch, seq);
    losses[j] = model.forward_backward(tokens, tokens, params, grads, 1.0f / (batch * seq)).mean() -
                model.forward_loss(tokens, tokens, params).mean();
  }
  EXPECT_GT(losses[1], 0.5);
  EXPECT_NEAR(losses[0], losses[1], 1e-6 * losses[1]);
}

// Checkpoints record the loss keys; those from before them load with the defaults (the
// pooled loss, no z-loss). Resuming with other loss keys is allowed, as with
// router_aux_loss_coef: they weigh the training loss, they are not the architecture.
TEST(ModelMoe, CheckpointMetadataRecordsTheLossKeys) {
  CheckpointMetadata md;
  md.model = load_moe({{"model.router_aux_loss_coef", "0.01"}, {"model.router_aux_loss_type", "sequence"},
                       {"model.router_z_loss_coef", "0.001"}})
                 .model;
  md.flat_numel = 8;
  md.shards = {{0, 8}};
  md.tensors = {{"w", FlatState::Param, {2, 4}, 0, {{0, 0, 0, 32, 0}}}};
  const CheckpointMetadata back = metadata_from_json(metadata_to_json(md), "ck/metadata.json");
  EXPECT_EQ(back.model.router_aux_loss_type, "sequence");
  EXPECT_EQ(back.model.router_z_loss_coef, 0.001);
  nlohmann::json old = nlohmann::json::parse(metadata_to_json(md));
  old["model"].erase("router_aux_loss_type");
  old["model"].erase("router_z_loss_coef");
  const CheckpointMetadata before = metadata_from_json(old.dump(), "ck/metadata.json");
  EXPECT_EQ(before.model.router_aux_loss_type, "pooled");
  EXPECT_EQ(before.model.router_z_loss_coef, 0.0);
}

// Token dropping's keys (NOTE [MoE capacity] in ops/moe.h): recorded in checkpoints, the
// defaults (dropless) for checkpoints from before them; like the loss keys they are not the
// architecture, so resuming with others is allowed.
TEST(ModelMoe, CheckpointMetadataRecordsTheCapacityKeys) {
  CheckpointMetadata md;
  md.model = load_moe({{"model.moe_capacity_factor", "1.25"}, {"model.moe_token_drop_policy", "position"},
                       {"model.moe_pad_to_capacity", "true"}})
                 .model;
  md.flat_numel = 8;
  md.shards = {{0, 8}};
  md.tensors = {{"w", FlatState::Param, {2, 4}, 0, {{0, 0, 0, 32, 0}}}};
  const CheckpointMetadata back = metadata_from_json(metadata_to_json(md), "ck/metadata.json");
  EXPECT_EQ(back.model.moe_capacity_factor, 1.25);
  EXPECT_EQ(back.model.moe_token_drop_policy, "position");
  EXPECT_TRUE(back.model.moe_pad_to_capacity);
  nlohmann::json old = nlohmann::json::parse(metadata_to_json(md));
  for (const char* key : {"moe_capacity_factor", "moe_token_drop_policy", "moe_pad_to_capacity"})
    old["model"].erase(key);
  const CheckpointMetadata before = metadata_from_json(old.dump(), "ck/metadata.json");
  EXPECT_EQ(before.model.moe_capacity_factor, 0.0);
  EXPECT_EQ(before.model.moe_token_drop_policy, "probs");
  EXPECT_FALSE(before.model.moe_pad_to_capacity);
}

TEST(ModelMoe, CapacityKeysRules) {
  const ModelConfig m = load_moe().model;
  EXPECT_EQ(m.moe_capacity_factor, 0.0);
  EXPECT_EQ(m.moe_token_drop_policy, "probs");
  EXPECT_FALSE(m.moe_pad_to_capacity);
  const ModelConfig on = load_moe({{"model.moe_capacity_factor", "1.5"}, {"model.moe_token_drop_policy", "position"},
                                   {"model.moe_pad_to_capacity", "true"}})
                             .model;
  EXPECT_EQ(on.moe_capacity_factor, 1.5);
  EXPECT_EQ(on.moe_token_drop_policy, "position");
  EXPECT_TRUE(on.moe_pad_to_capacity);
  expect_error([] { load_moe({{"model.moe_capacity_factor", "-1"}}); }, {"model.moe_capacity_factor"});
  expect_error([] { load_moe({{"model.moe_capacity_factor", "1"}, {"model.moe_token_drop_policy", "random"}}); },
               {"model.moe_token_drop_policy"});
  expect_error([] { load_moe({{"model.moe_pad_to_capacity", "true"}}); },
               {"model.moe_pad_to_capacity", "needs model.moe_capacity_factor > 0"});
  expect_error([] { load_moe({{"model.moe_token_drop_policy", "position"}}); },
               {"model.moe_token_drop_policy = position (command line) needs model.moe_capacity_factor > 0"});
  expect_error([] { load({{"model.moe_capacity_factor", "1"}}); },
               {"model.moe_capacity_factor", "needs model.num_experts > 0"});
  expect_error([] { load({{"model.moe_pad_to_capacity", "true"}}); }, {"model.moe_pad_to_capacity", "num_experts > 0"});
}

TEST(ModelMoe, DenseModelsHaveNoExpertLoad) {
  const ModelConfig m = load({}).model;
  DecoderLM model(m, 1, 4);
  EXPECT_TRUE(model.expert_load().empty());
}

TEST(ModelMoe, BlockParametersAreTheRouterAndStackedExperts) {
  const ModelConfig m = load_moe().model;
  std::vector<std::string> names;
  for (const ParamSpec& spec : parameter_specs(m))
    if (spec.layer == 0) names.push_back(spec.name);
  EXPECT_EQ(names, (std::vector<std::string>{"layers.0.attn_norm.weight", "layers.0.attention.qkv.weight",
                                             "layers.0.attention.o.weight", "layers.0.mlp_norm.weight",
                                             "layers.0.moe.router.weight", "layers.0.moe.experts.gate_up",
                                             "layers.0.moe.experts.down"}));
  int64_t sum = 0;
  for (const ParamSpec& spec : parameter_specs(m)) sum += shape_numel(spec.shape);
  EXPECT_EQ(sum, m.total_params());
}

// A few steps of the CPU model on one batch, with the balancing loss (each form, the last
// with the z-loss; then with token dropping, by each policy, padded or not): the loss falls,
// under each checkpointing mode, and the modes agree (the routing is recomputed the same).
class ModelMoeTrains : public ::testing::TestWithParam<ConfigOverrides> {};

INSTANTIATE_TEST_SUITE_P(Losses, ModelMoeTrains,
                         ::testing::Values(ConfigOverrides{{"model.router_aux_loss_coef", "0.01"}},
                                           ConfigOverrides{{"model.router_aux_loss_coef", "0.01"},
                                                           {"model.router_aux_loss_type", "per_layer"}},
                                           ConfigOverrides{{"model.router_aux_loss_coef", "0.01"},
                                                           {"model.router_aux_loss_type", "sequence"},
                                                           {"model.router_z_loss_coef", "0.001"}},
                                           ConfigOverrides{{"model.router_aux_loss_coef", "0.01"},
                                                           {"model.moe_capacity_factor", "1.0"}},
                                           ConfigOverrides{{"model.router_aux_loss_coef", "0.01"},
                                                           {"model.router_aux_loss_type", "per_layer"},
                                                           {"model.moe_capacity_factor", "0.75"},
                                                           {"model.moe_token_drop_policy", "position"},
                                                           {"model.moe_pad_to_capacity", "true"}},
                                           ConfigOverrides{{"model.moe_capacity_factor", "1.5"},
                                                           {"model.moe_pad_to_capacity", "true"}}));

TEST_P(ModelMoeTrains, UnderEveryCheckpointMode) {
  const ModelConfig m = load_moe(GetParam()).model;
  const int64_t batch = 2, seq = 16;
  Rng rng(11);
  Tensor tokens = Tensor::empty({batch, seq}, DType::I32), targets = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t i = 0; i < batch * seq; ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.below(m.vocab_size));
    targets.data<int32_t>()[i] = static_cast<int32_t>((tokens.data<int32_t>()[i] + 1) % m.vocab_size);
  }
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
    // Each block's routing: every token's top-k assignments, spread over the experts; with
    // a capacity at most that many per expert (NOTE [MoE capacity]).
    const std::vector<std::vector<int64_t>> load = model.expert_load();
    ASSERT_EQ(load.size(), static_cast<size_t>(m.num_layers));
    const int64_t capacity = MoeCapacity{m.moe_capacity_factor}.capacity(batch * seq, m.num_experts_per_tok,
                                                                         m.num_experts);
    for (const std::vector<int64_t>& block : load) {
      ASSERT_EQ(block.size(), static_cast<size_t>(m.num_experts));
      int64_t total = 0;
      for (int64_t n : block) {
        total += n;
        if (capacity > 0) EXPECT_LE(n, capacity);
      }
      if (capacity == 0) EXPECT_EQ(total, batch * seq * m.num_experts_per_tok);
      else EXPECT_LE(total, batch * seq * m.num_experts_per_tok);
    }
    curves.push_back(losses);
  }
  EXPECT_EQ(curves[1], curves[0]);
  EXPECT_EQ(curves[2], curves[0]);
  // Checkpointing saves MoE memory: selective drops each layer's normalized input, its
  // permutation and SwiGLU; full keeps one set for all layers.
  const int64_t none = activation_bytes(m, batch, seq, DType::F32, ActivationCheckpoint::None),
                selective = activation_bytes(m, batch, seq, DType::F32, ActivationCheckpoint::Selective),
                full = activation_bytes(m, batch, seq, DType::F32, ActivationCheckpoint::Full);
  EXPECT_LT(selective, none);
  EXPECT_LT(full, selective);
}

}  // namespace
}  // namespace forge
