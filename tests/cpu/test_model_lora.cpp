// LoRA at the model level (model/lora.h, NOTE [LoRA training]): which projections carry
// adapters, what is trainable (the adapters only: the gradient sink hands out no base
// weight, embedding or head gradient), PEFT's initialization, and the lora.* rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "expect_error.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/memory_estimate.h"
#include "model_testing.h"
#include "ops_testing.h"

namespace forge {
namespace {

LoraConfig lora(int64_t rank, const std::string& targets) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = 8.0;
  c.target_modules = targets;
  return c;
}

TEST(ModelLora, TargetsAreThePartsOfTheFusedProjections) {
  const ModelConfig config = testing::tiny();
  const std::vector<LoraTarget> targets = lora_targets(config, lora_target_modules("v_proj,up_proj,q_proj"));
  ASSERT_EQ(targets.size(), 2u * static_cast<size_t>(config.num_layers));
  const LoraTarget& qkv = targets[0];
  EXPECT_EQ(qkv.name, "layers.0.attention.qkv.weight");
  ASSERT_EQ(qkv.parts.size(), 2u);
  EXPECT_EQ(qkv.parts[0].module, "q_proj");
  EXPECT_EQ(qkv.parts[0].row_end, config.q_size());
  EXPECT_EQ(qkv.parts[1].module, "v_proj");
  EXPECT_EQ(qkv.parts[1].row_begin, config.q_size() + config.kv_size());
  EXPECT_EQ(peft_tensor_name(qkv.parts[1], 'a'), "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight");
  const LoraTarget& gate_up = targets[1];
  ASSERT_EQ(gate_up.parts.size(), 1u);
  EXPECT_EQ(gate_up.parts[0].row_begin, config.ffn_hidden_size);
  EXPECT_EQ(lora_targets(config, lora_target_modules("all-linear")).size(), 4u * static_cast<size_t>(config.num_layers));
}

// NOTE [Fused LoRA targets]: qkv_proj is one adapter over the whole fused projection, and
// computes what separate q, k, v adapters compute when they share that A and split B's rows.
TEST(ModelLora, AFusedTargetIsOneAdapterOverTheWholeProjection) {
  const ModelConfig config = testing::tiny();
  EXPECT_EQ(lora_target_modules("o_proj,qkv_proj"), (std::vector<std::string>{"qkv_proj", "o_proj"}));
  expect_error([] { lora_target_modules("qkv_proj,k_proj"); },
               {"lora.target_modules", "'qkv_proj' adapts q_proj, k_proj, v_proj whole", "'k_proj'"});
  expect_error([] { lora_target_modules("gate_up_proj,up_proj"); }, {"'gate_up_proj'", "'up_proj'"});
  const std::vector<LoraTarget> targets = lora_targets(config, lora_target_modules("qkv_proj,gate_up_proj"));
  ASSERT_EQ(targets.size(), 2u * static_cast<size_t>(config.num_layers));
  ASSERT_EQ(targets[0].parts.size(), 1u);
  EXPECT_EQ(targets[0].parts[0].module, "qkv_proj");
  EXPECT_EQ(targets[0].parts[0].row_begin, 0);
  EXPECT_EQ(targets[0].parts[0].row_end, config.q_size() + 2 * config.kv_size());
  EXPECT_EQ(peft_tensor_name(targets[0].parts[0], 'b'), "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight");
  EXPECT_EQ(targets[1].parts[0].hf_prefix, "model.layers.0.mlp.gate_up_proj");
  const int64_t r = 4, h = config.hidden_size, q = config.q_size(), kv = config.kv_size();
  LoraAdapters fused(config, lora(r, "qkv_proj"), Device::CPU, 16);
  EXPECT_EQ(fused.trainable_params(), r * (h + q + 2 * kv) * config.num_layers);

  LoraAdapters split(config, lora(r, "q_proj,k_proj,v_proj"), Device::CPU, 16);
  fused.initialize(3);
  testing::set_nonzero_lora_b(fused);
  for (size_t k = 0; k < fused.targets().size(); ++k) {
    const Tensor& fa = fused.masters()[2 * k];
    const Tensor& fb = fused.masters()[2 * k + 1];  // [out, r]
    const Tensor& sa = split.masters()[2 * k];      // [3r, in]: A three times
    const Tensor& sb = split.masters()[2 * k + 1];  // [out, 3r]: part p's rows in columns [p r, (p+1) r)
    for (int p = 0; p < 3; ++p)
      std::copy(fa.data<float>(), fa.data<float>() + fa.numel(), sa.data<float>() + p * fa.numel());
    const int64_t bounds[4] = {0, q, q + kv, q + 2 * kv};
    for (int p = 0; p < 3; ++p)
      for (int64_t row = bounds[p]; row < bounds[p + 1]; ++row)
        for (int64_t c = 0; c < r; ++c)
          sb.data<float>()[row * 3 * r + p * r + c] = fb.data<float>()[row * r + c];
  }
  FlatParameters base(config);
  base.initialize(1);
  fused.set_base(base);
  split.set_base(base);
  DecoderLM model(config, 2, 8);
  const Tensor tokens = testing::random_tokens(2, 8, config.vocab_size, 3);
  const Tensor targets_ids = testing::random_tokens(2, 8, config.vocab_size, 4);
  const double base_loss = model.forward_loss(tokens, targets_ids, base).mean();
  const double fused_loss = model.forward_loss(tokens, targets_ids, fused).mean();
  EXPECT_NE(fused_loss, base_loss);
  EXPECT_NEAR(model.forward_loss(tokens, targets_ids, split).mean(), fused_loss, 1e-6 * std::abs(fused_loss));
}

TEST(ModelLora, OnlyTheAdaptersAreTrainable) {
  const ModelConfig config = testing::tiny();
  LoraAdapters adapters(config, lora(4, "all-linear"), Device::CPU, 16);
  const int64_t h = config.hidden_size, f = config.ffn_hidden_size, q = config.q_size(), kv = config.kv_size();
  const int64_t per_layer = 4 * ((h + q) + (h + kv) + (h + kv) + (q + h) + (h + f) + (h + f) + (f + h));
  EXPECT_EQ(adapters.trainable_params(), per_layer * config.num_layers);
  EXPECT_EQ(adapters.masters().size(), 2u * adapters.targets().size());
  EXPECT_EQ(adapters.gradients().size(), adapters.masters().size());
  // The gradient sink hands out no gradient of a frozen parameter.
  EXPECT_FALSE(adapters.embedding_grad().defined());
  EXPECT_FALSE(adapters.output_grad().weight.defined());
  for (int i = 0; i < config.num_layers; ++i)
    for (const LinearWeight& g : adapters.layer_grads(i).params) {
      if (g.weight.defined()) EXPECT_EQ(g.weight.ndim(), 1) << "only norm weights get a (scratch) buffer";
      else EXPECT_NE(g.lora, nullptr) << "every projection is adapted under all-linear";
    }
}

TEST(ModelLora, PeftInitializationAndTrainingLeavesTheBaseAlone) {
  const ModelConfig config = testing::tiny();
  LoraAdapters adapters(config, lora(2, "q_proj,down_proj"), Device::CPU, 2 * 8);
  adapters.initialize(5);
  for (size_t k = 0; k < adapters.targets().size(); ++k) {
    const Tensor& a = adapters.masters()[2 * k];
    const Tensor& b = adapters.masters()[2 * k + 1];
    const double bound = 1.0 / std::sqrt(static_cast<double>(adapters.targets()[k].in));
    double largest = 0.0;
    for (int64_t i = 0; i < a.numel(); ++i) largest = std::max(largest, std::abs(double(a.data<float>()[i])));
    EXPECT_LE(largest, bound);
    EXPECT_GT(largest, 0.5 * bound);
    for (int64_t i = 0; i < b.numel(); ++i) ASSERT_EQ(b.data<float>()[i], 0.0f);
  }
  // B = 0: the adapted model computes the base model's loss; a backward leaves the base
  // weights untouched and gives A no gradient (B is zero) but B one.
  FlatParameters base(config);
  base.initialize(1);
  const Tensor before = base.flat().clone();
  adapters.set_base(base);
  DecoderLM model(config, 2, 8);
  const Tensor tokens = testing::random_tokens(2, 8, config.vocab_size, 3);
  const Tensor targets = testing::random_tokens(2, 8, config.vocab_size, 4);
  const double base_loss = model.forward_loss(tokens, targets, base).mean();
  adapters.discard();
  EXPECT_DOUBLE_EQ(model.forward_backward(tokens, targets, adapters, adapters, 1.0f / 16).mean(), base_loss);
  EXPECT_TRUE(testing::bitwise_equal(base.flat(), before));
  double a_grad = 0.0, b_grad = 0.0;
  for (size_t k = 0; k < adapters.gradients().size(); ++k)
    for (int64_t i = 0; i < adapters.gradients()[k].numel(); ++i)
      (k % 2 ? b_grad : a_grad) += std::abs(double(adapters.gradients()[k].data<float>()[i]));
  EXPECT_EQ(a_grad, 0.0);
  EXPECT_GT(b_grad, 0.0);
}

TEST(ModelLora, SizesAndMemoryEstimateCountNoStateForTheBase) {
  const ModelConfig config = testing::tiny();
  LoraConfig c = lora(4, "q_proj,k_proj,down_proj");
  c.dropout = 0.1;
  const LoraAdapters adapters(config, c, Device::CPU, 32);
  const LoraSizes sizes = lora_sizes(config, c, 32);
  EXPECT_EQ(sizes.stored, adapters.stored_values());
  EXPECT_EQ(sizes.trainable, adapters.trainable_params());

  MemoryPlan plan;
  plan.micro_batch = 2;
  plan.seq_len = 16;
  plan.cuda = true;
  const MemoryEstimate full = estimate_memory(config, plan);
  plan.lora = c;
  const MemoryEstimate e = estimate_memory(config, plan);
  const double params = static_cast<double>(config.total_params()), stored = static_cast<double>(sizes.stored);
  EXPECT_EQ(e.frozen_weights, params * 2);  // bf16, no master
  EXPECT_EQ(e.master_weights, stored * 4);
  EXPECT_EQ(e.gradients, stored * 4);
  EXPECT_EQ(e.optimizer_state, stored * 8);
  EXPECT_EQ(e.compute_weights, stored * 2);
  EXPECT_EQ(e.activations, full.activations + static_cast<double>(sizes.workspace) * 2);
  EXPECT_NE(describe(e).find("frozen bf16 weights"), std::string::npos);
}

// NOTE [Frozen FSDP base]: under FSDP a rank holds 1/N of the frozen base plus what the
// ZeRO stage keeps in full; the adapters stay whole and nothing is reduce-scattered.
TEST(ModelLora, MemoryEstimateUnderFsdpShardsTheBase) {
  const ModelConfig config = testing::tiny();
  MemoryPlan plan;
  plan.micro_batch = 2;
  plan.seq_len = 16;
  plan.cuda = true;
  plan.lora = lora(4, "all-linear");
  const MemoryEstimate one = estimate_memory(config, plan);
  plan.fsdp = true;
  plan.shard_ranks = 4;
  plan.micro_batches = 2;
  const double params = static_cast<double>(config.total_params());
  const double block = static_cast<double>(config.largest_layer_params());
  const double embedding = static_cast<double>(config.vocab_size * config.hidden_size);
  const double head = params - embedding - block * static_cast<double>(config.num_layers);
  // ZeRO-3 gathers three blocks, or as many as the model has where it has fewer.
  const double slots = static_cast<double>(std::min<int64_t>(3, config.num_layers));
  for (int64_t stage : {1, 3}) {
    plan.zero_stage = stage;
    const MemoryEstimate e = estimate_memory(config, plan);
    EXPECT_EQ(e.frozen_weights, (params / 4 + (stage == 3 ? embedding + head + slots * block : params)) * 2) << stage;
    EXPECT_EQ(e.master_weights, one.master_weights);  // the adapters, whole on every rank
    EXPECT_EQ(e.optimizer_state, one.optimizer_state);
    EXPECT_EQ(e.gradients, one.gradients);
    EXPECT_EQ(e.comm_buffers, 0);
    EXPECT_EQ(e.activations, one.activations);
  }
}

// The adapters' gradients do not depend on what activation checkpointing drops and
// recomputes (dropout included: the masks are recomputed from their seeds).
TEST(ModelLora, EveryCheckpointingModeGivesTheSameGradients) {
  const ModelConfig config = testing::tiny();
  LoraConfig c = lora(3, "all-linear");
  c.dropout = 0.2;
  FlatParameters base(config);
  base.initialize(1);
  const Tensor tokens = testing::random_tokens(2, 8, config.vocab_size, 3);
  const Tensor targets = testing::random_tokens(2, 8, config.vocab_size, 4);
  std::vector<Tensor> grads;
  for (ActivationCheckpoint mode : {ActivationCheckpoint::None, ActivationCheckpoint::Selective,
                                    ActivationCheckpoint::Full}) {
    LoraAdapters adapters(config, c, Device::CPU, 16);
    adapters.initialize(2);
    testing::set_nonzero_lora_b(adapters);
    adapters.set_base(base);
    adapters.set_dropout_step(9, 0);
    DecoderLM model(config, 2, 8, Device::CPU, DType::F32, mode);
    adapters.discard();
    model.forward_backward(tokens, targets, adapters, adapters, 1.0f / 16);
    grads.push_back(adapters.gradient_flat().clone());
  }
  EXPECT_TRUE(testing::bitwise_equal(grads[0], grads[1]));
  EXPECT_TRUE(testing::bitwise_equal(grads[0], grads[2]));
}

TEST(ModelLora, ConfigRulesNameTheKey) {
  EXPECT_EQ(lora_target_modules("all-linear"), kLoraModules);
  EXPECT_EQ(lora_target_modules(" v_proj , q_proj"), (std::vector<std::string>{"q_proj", "v_proj"}));
  expect_error([] { lora_target_modules("q_proj,qproj"); },
                        {"lora.target_modules", "'qproj' is not a module of the decoder", "all-linear"});
  expect_error([] { lora_target_modules("q_proj,q_proj"); }, {"'q_proj' is named twice"});
  expect_error([] { lora_target_modules("q_proj,"); }, {"empty module name"});
  expect_error([] { lora_target_modules("all-linear,q_proj"); }, {"all-linear already names every module"});
  LoraConfig c = lora(0, "q_proj");
  c.adapter_path = "adapter";
  expect_error([&] { c.validate(); }, {"lora.adapter_path", "lora.rank"});
  c = lora(8, "q_proj");
  c.dropout = 1.0;
  expect_error([&] { c.validate(); }, {"lora.dropout must be in [0, 1)"});
}

}  // namespace
}  // namespace forge
