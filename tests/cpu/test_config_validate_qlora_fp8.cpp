// precision.fp8 with QLoRA (NOTE [FP8 over an NF4 base] in model/nf4_base.cpp): accepted
// wherever QLoRA runs (one device, data, context and pipeline parallelism), with either
// recipe, on dense, Mixture-of-Experts and MLA models (NOTE [FP8 over NF4 expert stacks]);
// what stays refused is refused by name: the FP8 all-gather (full training's), QLoRA under
// tensor parallelism whose shards are not whole NF4 blocks.
#include <gtest/gtest.h>

#include "cli/config.h"
#include "cli/config_validate.h"
#include "config_test_support.h"

namespace forge {
namespace {

using config_test::expect_error;

ExperimentConfig load(const ConfigOverrides& overrides) { return load_experiment("", overrides); }

ConfigOverrides qlora_fp8(const char* recipe, ConfigOverrides more = {}) {
  ConfigOverrides o = {{"precision.fp8", recipe}, {"lora.rank", "4"}, {"lora.quantize_base", "nf4"}};
  o.insert(o.end(), more.begin(), more.end());
  return o;
}

TEST(ConfigValidateQloraFp8, AcceptedWhereverQloraRuns) {
  for (const char* recipe : {"tensorwise", "delayed"}) {
    SCOPED_TRACE(recipe);
    EXPECT_EQ(load(qlora_fp8(recipe)).precision.fp8, recipe);
    EXPECT_EQ(load(qlora_fp8(recipe, {{"training.device", "cuda"}})).lora.quantize_base, "nf4");
    EXPECT_EQ(load(qlora_fp8(recipe, {{"parallelism.data_parallel_shard_degree", "2"}})).precision.fp8, recipe);
    EXPECT_EQ(load(qlora_fp8(recipe, {{"parallelism.data_parallel_replicate_degree", "2"}})).precision.fp8, recipe);
    EXPECT_EQ(load(qlora_fp8(recipe, {{"parallelism.context_parallel_degree", "2"}})).precision.fp8, recipe);
    EXPECT_EQ(load(qlora_fp8(recipe, {{"parallelism.pipeline_parallel_degree", "2"}})).precision.fp8, recipe);
    EXPECT_EQ(load(qlora_fp8(recipe, {{"parallelism.pipeline_parallel_degree", "2"},
                                      {"parallelism.data_parallel_shard_degree", "2"}}))
                  .precision.fp8,
              recipe);
  }
}

// Mixture-of-Experts and MLA models too (NOTE [FP8 over NF4 expert stacks] in
// model/nf4_base.cpp), on one device and under expert and pipeline x expert parallelism.
TEST(ConfigValidateQloraFp8, AcceptedOnMoeAndMlaModels) {
  for (const char* recipe : {"tensorwise", "delayed"})
    for (const char* model : {"debug-tiny-moe", "debug-tiny-mla"}) {
      SCOPED_TRACE(::testing::Message() << recipe << " " << model);
      EXPECT_EQ(load(qlora_fp8(recipe, {{"model.name", model}})).precision.fp8, recipe);
      EXPECT_EQ(load(qlora_fp8(recipe, {{"model.name", model}, {"training.device", "cuda"}, {"model.num_experts", "8"}})).lora.quantize_base,
                "nf4");
      EXPECT_EQ(load(qlora_fp8(recipe, {{"model.name", model},
                                        {"parallelism.data_parallel_shard_degree", "2"},
                                        {"parallelism.expert_parallel_degree", "2"}}))
                    .precision.fp8,
                recipe);
      EXPECT_EQ(load(qlora_fp8(recipe, {{"model.name", model},
                                        {"model.num_layers", "4"},
                                        {"parallelism.pipeline_parallel_degree", "2"},
                                        {"parallelism.data_parallel_shard_degree", "2"},
                                        {"parallelism.expert_parallel_degree", "2"}}))
                    .precision.fp8,
                recipe);
    }
}

TEST(ConfigValidateQloraFp8, WhatStaysRefusedIsNamed) {
  expect_error(
      [] {
        load(qlora_fp8("tensorwise", {{"precision.fp8_fsdp_all_gather", "true"},
                                      {"parallelism.data_parallel_shard_degree", "2"}}));
      },
      {"precision.fp8_fsdp_all_gather", "QLoRA's NF4 base is not sharded"});
  // Under tensor parallelism whose shards are whole NF4 blocks (NOTE [NF4 base under tensor
  // parallelism]) it runs; debug-tiny's o projection would give each rank 32 columns.
  expect_error([] { load(qlora_fp8("tensorwise", {{"parallelism.tensor_parallel_degree", "2"}})); },
               {"with lora.quantize_base = nf4", "multiple of NF4's block of 64"});
  EXPECT_EQ(load(qlora_fp8("tensorwise", {{"parallelism.tensor_parallel_degree", "2"}, {"model.hidden_size", "128"},
                                          {"model.ffn_hidden_size", "256"}}))
                .precision.fp8,
            "tensorwise");
  // Hopper's FP8 GEMMs' widths, as for LoRA (the tokens are never contracted: no weight gradient).
  expect_error([] { load(qlora_fp8("tensorwise", {{"training.device", "cuda"}, {"model.ffn_hidden_size", "200"}})); },
               {"multiple of 16", "model.ffn_hidden_size is 200"});
  EXPECT_EQ(load(qlora_fp8("tensorwise", {{"training.device", "cuda"}, {"training.seq_len", "63"},
                                          {"training.local_batch_size", "1"}}))
                .training.seq_len,
            63);
}

}  // namespace
}  // namespace forge
