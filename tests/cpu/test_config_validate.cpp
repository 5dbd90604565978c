// Cross-key validation and batch-size derivation. Messages name every key involved, its
// value and where the value came from.
#include <gtest/gtest.h>

#include "cli/config.h"
#include "cli/config_validate.h"
#include "config_test_support.h"

namespace forge {
namespace {

using config_test::expect_error;
using config_test::ScratchDir;

ExperimentConfig load(const ConfigOverrides& overrides) { return load_experiment("", overrides); }

TEST(ConfigValidate, HeadsMustDivideByKvHeads) {
  expect_error([] { load({{"model.num_kv_heads", "3"}}); },
               {"model.num_heads = 4 (", "debug-tiny.yaml:7)",
                "must be divisible by model.num_kv_heads = 3 (command line)"});
}

TEST(ConfigValidate, HiddenMustDivideByHeadsUnlessHeadDimIsGiven) {
  expect_error([] { load({{"model.hidden_size", "66"}, {"model.num_kv_heads", "4"}}); },
               {"model.hidden_size = 66 (command line)", "model.num_heads = 4", "model.head_dim is not given"});
  const ExperimentConfig config = load({{"model.hidden_size", "66"}, {"model.head_dim", "16"}});
  EXPECT_EQ(config.model.resolved_head_dim(), 16);
}

TEST(ConfigValidate, HeadDimMustBeEven) {
  expect_error([] { load({{"model.head_dim", "15"}}); }, {"must be even", "model.head_dim = 15 (command line)"});
  expect_error([] { load({{"model.hidden_size", "36"}}); }, {"must be even", "got 9", "model.hidden_size = 36"});
}

TEST(ConfigValidate, NF4BaseNeedsAdapters) {
  EXPECT_EQ(load({}).lora.quantize_base, "none");
  expect_error([] { load({{"lora.quantize_base", "nf4"}}); },
               {"lora.quantize_base = nf4 (command line)", "set lora.rank > 0 (it is 0)", "lora.quantize_base none"});
  EXPECT_EQ(load({{"lora.quantize_base", "nf4"}, {"lora.rank", "4"}}).lora.quantize_base, "nf4");
  expect_error([] { load({{"lora.quantize_base", "int4"}}); }, {"lora.quantize_base", "none", "nf4"});
}

// LoRA shards its frozen base under data parallelism, QLoRA replicates its NF4 base (NOTE
// [LoRA under data parallelism]): both pass the check on several ranks.
TEST(ConfigValidate, LoraAndQloraRunOnDataParallelRanks) {
  const ExperimentConfig hybrid = load({{"lora.rank", "4"}, {"parallelism.data_parallel_shard_degree", "2"},
                                        {"parallelism.data_parallel_replicate_degree", "2"}});
  EXPECT_EQ(hybrid.training.global_batch_size, 4 * hybrid.training.local_batch_size *
                                                   hybrid.training.gradient_accumulation_steps);
  const ExperimentConfig qlora =
      load({{"lora.rank", "4"}, {"lora.quantize_base", "nf4"}, {"parallelism.data_parallel_shard_degree", "2"}});
  EXPECT_EQ(qlora.lora.quantize_base, "nf4");
}

// NOTE [LoRA under context and tensor parallelism]: LoRA and QLoRA on context-parallel and
// tensor-parallel ranks; QLoRA on the latter when every shard is whole NF4 blocks (NOTE [NF4
// base under tensor parallelism]), the projection and key that would cut them named.
TEST(ConfigValidate, LoraRunsOnContextAndTensorParallelRanks) {
  EXPECT_EQ(load({{"lora.rank", "4"}, {"parallelism.context_parallel_degree", "2"},
                  {"parallelism.data_parallel_shard_degree", "2"}})
                .lora.rank,
            4);
  EXPECT_EQ(load({{"lora.rank", "4"}, {"lora.quantize_base", "nf4"}, {"parallelism.context_parallel_degree", "2"}})
                .lora.quantize_base,
            "nf4");
  EXPECT_EQ(load({{"lora.rank", "4"}, {"parallelism.tensor_parallel_degree", "2"},
                  {"parallelism.context_parallel_degree", "2"}})
                .parallelism.tensor_parallel_degree,
            2);
  // debug-tiny's o has 64 columns (32 a rank) and down 192 (96 a rank): not whole blocks of 64.
  expect_error(
      [] { load({{"lora.rank", "4"}, {"lora.quantize_base", "nf4"}, {"parallelism.tensor_parallel_degree", "2"}}); },
      {"parallelism.tensor_parallel_degree = 2 (command line) with lora.quantize_base = nf4 (command line): QLoRA "
       "under tensor parallelism over 2 ranks: each rank quantizes its 32 columns of layers.0",
       "model.num_heads x head dim 64 / 2 = 32"});
  expect_error(
      [] {
        load({{"lora.rank", "4"}, {"lora.quantize_base", "nf4"}, {"parallelism.tensor_parallel_degree", "2"},
              {"model.hidden_size", "128"}});
      },
      {"its 96 columns of layers.0", "model.ffn_hidden_size 192 / 2 = 96"});
  const ConfigOverrides wide = {{"lora.rank", "4"},
                                {"lora.quantize_base", "nf4"},
                                {"parallelism.tensor_parallel_degree", "2"},
                                {"model.hidden_size", "128"},
                                {"model.ffn_hidden_size", "256"}};
  EXPECT_EQ(load(wide).lora.quantize_base, "nf4");
  ConfigOverrides wide_fsdp = wide;
  wide_fsdp.push_back({"parallelism.data_parallel_shard_degree", "2"});
  EXPECT_EQ(load(wide_fsdp).parallelism.data_parallel_shard_degree, 2);
  EXPECT_EQ(load({{"lora.rank", "4"}, {"lora.dropout", "0.1"}, {"parallelism.tensor_parallel_degree", "2"}})
                .lora.dropout,
            0.1);
}

// NOTE [LoRA under pipeline parallelism]: LoRA and QLoRA on pipeline ranks composed with data,
// context and tensor parallelism, and LoRA's FP8 frozen base stage by stage; what the other
// degrees refuse without pipelining stays refused, named.
TEST(ConfigValidate, LoraRunsOnPipelineRanksWithTheOtherDegrees) {
  const ConfigOverrides pp = {{"lora.rank", "4"}, {"parallelism.pipeline_parallel_degree", "2"},
                              {"parallelism.zero_stage", "1"}};
  auto with = [&](ConfigOverrides more) {
    ConfigOverrides all = pp;
    all.insert(all.end(), more.begin(), more.end());
    return load(all);
  };
  EXPECT_EQ(with({{"parallelism.data_parallel_shard_degree", "2"}}).parallelism.data_parallel_shard_degree, 2);
  EXPECT_EQ(with({{"parallelism.data_parallel_replicate_degree", "2"}}).parallelism.data_parallel_replicate_degree, 2);
  EXPECT_EQ(with({{"parallelism.context_parallel_degree", "2"}}).parallelism.context_parallel_degree, 2);
  EXPECT_EQ(with({{"parallelism.tensor_parallel_degree", "2"}}).parallelism.tensor_parallel_degree, 2);
  EXPECT_EQ(with({{"lora.quantize_base", "nf4"}, {"parallelism.data_parallel_shard_degree", "2"}}).lora.quantize_base,
            "nf4");
  EXPECT_EQ(with({{"precision.fp8", "delayed"}}).precision.fp8, "delayed");
  EXPECT_EQ(with({{"precision.fp8", "tensorwise"}, {"parallelism.data_parallel_shard_degree", "2"}}).precision.fp8,
            "tensorwise");
  expect_error([&] { with({{"lora.quantize_base", "nf4"}, {"parallelism.tensor_parallel_degree", "2"}}); },
               {"parallelism.tensor_parallel_degree = 2 (command line) with lora.quantize_base = nf4",
                "its 32 columns of layers.0"});
  EXPECT_EQ(with({{"lora.quantize_base", "nf4"}, {"parallelism.tensor_parallel_degree", "2"},
                  {"model.hidden_size", "128"}, {"model.ffn_hidden_size", "256"}})
                .lora.quantize_base,
            "nf4");
  EXPECT_EQ(with({{"precision.fp8", "tensorwise"}, {"parallelism.tensor_parallel_degree", "2"}}).precision.fp8,
            "tensorwise");  // NOTE [FP8 under tensor parallelism]: LoRA's FP8 base too
  // NOTE [ZeRO-2 and -3 under pipeline parallelism]: the frozen base over the stages under
  // any ZeRO stage, with expert parallelism too (its expert parts gathered per use over their
  // groups), and QLoRA's NF4 base there.
  for (const char* zero : {"2", "3"}) {
    EXPECT_EQ(with({{"parallelism.data_parallel_shard_degree", "2"}, {"parallelism.zero_stage", zero}})
                  .parallelism.zero_stage,
              std::stoi(zero));
    const ConfigOverrides moe_ep = {{"model.name", "debug-tiny-moe"},
                                    {"model.num_layers", "4"},
                                    {"parallelism.data_parallel_shard_degree", "2"},
                                    {"parallelism.expert_parallel_degree", "2"},
                                    {"parallelism.zero_stage", zero}};
    EXPECT_EQ(with(moe_ep).parallelism.zero_stage, std::stoi(zero));
    ConfigOverrides qlora = moe_ep;
    qlora.push_back({"lora.quantize_base", "nf4"});
    EXPECT_EQ(with(qlora).lora.quantize_base, "nf4");
    // NOTE [FP8 under ZeRO-2 and -3 pipeline ranks]: LoRA's FP8 base over the stages.
    EXPECT_EQ(with({{"parallelism.data_parallel_shard_degree", "2"}, {"parallelism.zero_stage", zero},
                    {"precision.fp8", "delayed"}})
                  .precision.fp8,
              "delayed");
  }
}

// parallelism.zero_stage defaults to 1 under pipeline parallelism, 3 otherwise; an explicit
// 2 or 3 under pipelining runs full training (NOTE [ZeRO-2 and -3 under pipeline
// parallelism]), with hybrid sharding, context, tensor and expert parallelism, and in FP8
// (NOTE [FP8 under ZeRO-2 and -3 pipeline ranks]).
TEST(ConfigValidate, ZeroStageDefaultsToOneUnderPipelining) {
  const ConfigOverrides fsdp = {{"parallelism.data_parallel_shard_degree", "2"}};
  EXPECT_EQ(load_experiment("", fsdp).parallelism.zero_stage, 3);
  ConfigOverrides pipelined = fsdp;
  pipelined.push_back({"parallelism.pipeline_parallel_degree", "2"});
  EXPECT_EQ(load_experiment("", pipelined).parallelism.zero_stage, 1);
  auto with = [&](ConfigOverrides more) {
    ConfigOverrides all = {{"parallelism.pipeline_parallel_degree", "2"}};
    all.insert(all.end(), more.begin(), more.end());
    return load_experiment("", all);
  };
  for (const char* zero : {"2", "3"}) {
    EXPECT_EQ(with({{"parallelism.data_parallel_shard_degree", "2"}, {"parallelism.zero_stage", zero}})
                  .parallelism.zero_stage,
              std::stoi(zero));
    EXPECT_EQ(with({{"parallelism.data_parallel_replicate_degree", "2"}, {"parallelism.zero_stage", zero}})
                  .parallelism.zero_stage,
              std::stoi(zero));
    EXPECT_EQ(with({{"parallelism.context_parallel_degree", "2"}, {"parallelism.zero_stage", zero}})
                  .parallelism.zero_stage,
              std::stoi(zero));
    EXPECT_EQ(with({{"parallelism.data_parallel_shard_degree", "2"}, {"parallelism.tensor_parallel_degree", "2"},
                    {"parallelism.zero_stage", zero}})
                  .parallelism.zero_stage,
              std::stoi(zero));
    EXPECT_EQ(with({{"model.name", "debug-tiny-moe"}, {"model.num_layers", "4"},
                    {"parallelism.data_parallel_shard_degree", "2"}, {"parallelism.expert_parallel_degree", "2"},
                    {"parallelism.zero_stage", zero}})
                  .parallelism.zero_stage,
              std::stoi(zero));
    // NOTE [FP8 under ZeRO-2 and -3 pipeline ranks].
    for (const char* recipe : {"tensorwise", "delayed"}) {
      EXPECT_EQ(with({{"parallelism.data_parallel_shard_degree", "2"}, {"parallelism.zero_stage", zero},
                      {"precision.fp8", recipe}})
                    .precision.fp8,
                recipe);
      EXPECT_EQ(with({{"parallelism.context_parallel_degree", "2"}, {"parallelism.zero_stage", zero},
                      {"precision.fp8", recipe}})
                    .precision.fp8,
                recipe);
    }
  }
  // What pipelining still refuses under ZeRO-2/3: the interleaved schedule's groups of micro-batches.
  expect_error([&] {
    with({{"parallelism.data_parallel_shard_degree", "2"}, {"parallelism.zero_stage", "3"},
          {"model.num_layers", "4"}, {"parallelism.pipeline_parallel_schedule", "Interleaved1F1B"},
          {"training.gradient_accumulation_steps", "3"}});
  },
               {"parallelism.pipeline_parallel_schedule = Interleaved1F1B (command line) takes the micro-batches in "
                "groups of parallelism.pipeline_parallel_degree = 2",
                "training.gradient_accumulation_steps = 3 (command line)"});
}

// NOTE [FP8 under tensor parallelism]: full training in FP8 on tensor-parallel ranks (alone
// and over FSDP, with its FP8 all-gather), and LoRA's FP8 frozen base.
TEST(ConfigValidate, Fp8TrainsOnTensorParallelRanks) {
  for (const char* recipe : {"tensorwise", "delayed"})
    EXPECT_EQ(load({{"precision.fp8", recipe}, {"parallelism.tensor_parallel_degree", "2"}}).precision.fp8, recipe);
  EXPECT_EQ(load({{"precision.fp8", "delayed"}, {"parallelism.tensor_parallel_degree", "2"},
                  {"parallelism.data_parallel_shard_degree", "2"}})
                .parallelism.tensor_parallel_degree,
            2);
  // LoRA's FP8 frozen base split over the ranks (alone and over FSDP's frozen base).
  for (const char* recipe : {"tensorwise", "delayed"})
    EXPECT_EQ(load({{"precision.fp8", recipe}, {"lora.rank", "4"}, {"parallelism.tensor_parallel_degree", "2"}})
                  .precision.fp8,
              recipe);
  EXPECT_EQ(load({{"precision.fp8", "tensorwise"}, {"lora.rank", "4"}, {"parallelism.tensor_parallel_degree", "2"},
                  {"parallelism.data_parallel_shard_degree", "2"}})
                .lora.rank,
            4);
  // QLoRA's NF4 base under tensor parallelism: whole NF4 blocks a shard (NOTE [NF4 base under
  // tensor parallelism]), which debug-tiny's are not.
  expect_error(
      [] {
        load({{"precision.fp8", "none"}, {"lora.rank", "4"}, {"lora.quantize_base", "nf4"},
              {"parallelism.tensor_parallel_degree", "2"}});
      },
      {"with lora.quantize_base = nf4", "NF4's block of 64"});
  // FSDP's FP8 all-gather over the tensor-parallel shards, in full training and of LoRA's
  // frozen base (NOTE [FP8 all-gather of a frozen base]).
  EXPECT_TRUE(load({{"precision.fp8", "tensorwise"}, {"precision.fp8_fsdp_all_gather", "true"},
                    {"parallelism.tensor_parallel_degree", "2"}, {"parallelism.data_parallel_shard_degree", "2"}})
                  .precision.fp8_fsdp_all_gather);
  EXPECT_TRUE(load({{"precision.fp8", "tensorwise"}, {"precision.fp8_fsdp_all_gather", "true"}, {"lora.rank", "4"},
                    {"parallelism.tensor_parallel_degree", "2"}, {"parallelism.data_parallel_shard_degree", "2"}})
                  .precision.fp8_fsdp_all_gather);
  // On MoE and MLA models too (NOTE [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h):
  // the routed experts as one piece per expert (or in bf16 with precision.fp8_routed_experts
  // false), kv_a as its two row views; under expert parallelism the experts' slices in bf16.
  for (const char* model : {"debug-tiny-moe", "debug-tiny-mla"})
    for (const char* recipe : {"tensorwise", "delayed"})
      for (const char* routed_experts : {"true", "false"})
        for (const char* expert_parallel : {"1", "2"})
          EXPECT_TRUE(load({{"model.name", model}, {"precision.fp8", recipe}, {"precision.fp8_fsdp_all_gather", "true"},
                            {"precision.fp8_routed_experts", routed_experts},
                            {"parallelism.data_parallel_shard_degree", "4"},
                            {"parallelism.expert_parallel_degree", expert_parallel}})
                          .precision.fp8_fsdp_all_gather)
              << model << " " << recipe << " " << routed_experts << " " << expert_parallel;
}

// NOTE [Expert parallelism under hybrid sharding]: expert-parallel groups inside each
// replica, so the degree must divide the shard degree (not the data-parallel ranks); under
// pipelining too.
TEST(ConfigValidate, ExpertParallelRunsUnderHybridSharding) {
  const ConfigOverrides hsdp_ep = {{"model.name", "debug-tiny-moe"},
                                   {"parallelism.data_parallel_shard_degree", "2"},
                                   {"parallelism.data_parallel_replicate_degree", "2"},
                                   {"parallelism.expert_parallel_degree", "2"}};
  const ExperimentConfig config = load(hsdp_ep);
  EXPECT_EQ(config.parallelism.expert_parallel_degree, 2);
  EXPECT_EQ(config.parallelism.data_parallel_replicate_degree, 2);
  ConfigOverrides pipelined = hsdp_ep;
  pipelined[0] = {"model.name", "debug-tiny-mla"};
  pipelined.push_back({"model.num_layers", "4"});
  pipelined.push_back({"parallelism.pipeline_parallel_degree", "2"});
  pipelined.push_back({"parallelism.zero_stage", "1"});
  EXPECT_EQ(load(pipelined).parallelism.pipeline_parallel_degree, 2);
  expect_error(
      [] {
        load({{"model.name", "debug-tiny-moe"}, {"parallelism.data_parallel_shard_degree", "2"},
              {"parallelism.data_parallel_replicate_degree", "2"}, {"parallelism.expert_parallel_degree", "4"}});
      },
      {"parallelism.expert_parallel_degree = 4 (command line) must divide parallelism.data_parallel_shard_degree = 2",
       "expert-parallel groups are formed from the shard ranks"});
}

// NOTE [Expert parallelism under pipeline parallelism]: expert-parallel groups of a
// stage's shard ranks; the degree must divide them, under any ZeRO stage; LoRA and QLoRA run
// under both.
TEST(ConfigValidate, ExpertParallelRunsUnderPipelineParallel) {
  const ConfigOverrides pp_ep = {{"model.name", "debug-tiny-mla"}, {"model.num_layers", "4"},
                                 {"parallelism.pipeline_parallel_degree", "2"},
                                 {"parallelism.data_parallel_shard_degree", "2"},
                                 {"parallelism.expert_parallel_degree", "2"}, {"parallelism.zero_stage", "1"}};
  EXPECT_EQ(load(pp_ep).parallelism.expert_parallel_degree, 2);
  ConfigOverrides interleaved = pp_ep;
  interleaved.push_back({"parallelism.pipeline_parallel_schedule", "Interleaved1F1B"});
  interleaved.push_back({"training.gradient_accumulation_steps", "2"});
  EXPECT_EQ(load(interleaved).parallelism.pipeline_parallel_schedule, "Interleaved1F1B");
  expect_error(
      [] {
        load({{"model.name", "debug-tiny-mla"}, {"model.num_layers", "4"},
              {"parallelism.pipeline_parallel_degree", "2"}, {"parallelism.expert_parallel_degree", "2"}});
      },
      {"parallelism.expert_parallel_degree = 2 (command line) must divide parallelism.data_parallel_shard_degree"});
  ConfigOverrides zero2 = pp_ep;
  zero2.back() = {"parallelism.zero_stage", "2"};
  EXPECT_EQ(load(zero2).parallelism.zero_stage, 2);  // NOTE [ZeRO-2 and -3 under pipeline parallelism]
  // NOTE [LoRA under pipeline and expert parallelism]: LoRA, the experts' adapters included;
  // QLoRA too (NOTE [QLoRA under pipeline and expert parallelism]).
  ConfigOverrides lora = pp_ep;
  lora.push_back({"lora.rank", "4"});
  lora.push_back({"lora.target_modules", "q_proj,gate,experts.gate_up_proj,experts.down_proj"});
  EXPECT_EQ(load(lora).lora.rank, 4);
  ConfigOverrides qlora = lora;
  qlora.push_back({"lora.quantize_base", "nf4"});
  EXPECT_EQ(load(qlora).lora.quantize_base, "nf4");
  // Every balancing loss, the global one included (NOTE [Global balancing loss across
  // stages]; it was refused under pipelining before), under both schedules.
  for (const char* type : {"pooled", "per_layer", "sequence", "global"})
    for (const ConfigOverrides& base : {pp_ep, interleaved}) {
      ConfigOverrides balanced = base;
      balanced.push_back({"model.router_aux_loss_coef", "0.01"});
      balanced.push_back({"model.router_aux_loss_type", type});
      EXPECT_EQ(load(balanced).model.router_aux_loss_type, type);
    }
}

// NOTE [Chunk attention with packed examples]: packed instruction data runs on
// context-parallel ranks.
TEST(ConfigValidate, PackedExamplesRunOnContextParallelRanks) {
  for (const char* source : {"sft", "govreport_npy"})
    EXPECT_EQ(load({{"data.source", source}, {"data.path", "/d/x"}, {"parallelism.context_parallel_degree", "2"}})
                  .parallelism.context_parallel_degree,
              2);
}

// NOTE [Ring attention with a sliding window]: ring attention takes Mistral's window; on
// CUDA not one whose W - 2 is a multiple of the chunk length (a band of a single query, which
// cuDNN does not take); packed examples stay with the all-gather.
TEST(ConfigValidate, RingAttentionTakesASlidingWindow) {
  const ConfigOverrides ring = {{"parallelism.context_parallel_degree", "2"},
                                {"parallelism.context_parallel_rotate_method", "p2p"},
                                {"training.seq_len", "64"}};  // chunks of 16
  auto with = [&](ConfigOverrides more) {
    ConfigOverrides all = ring;
    all.insert(all.end(), more.begin(), more.end());
    return load(all);
  };
  for (const char* window : {"4", "16", "18", "40"})
    EXPECT_EQ(with({{"model.sliding_window", window}}).model.sliding_window, std::stoll(window));
  EXPECT_EQ(with({{"model.sliding_window", "17"}, {"training.device", "cuda"}}).model.sliding_window, 17);
  EXPECT_EQ(with({{"model.sliding_window", "20"}, {"training.device", "cuda"}}).model.sliding_window, 20);
  for (const char* window : {"2", "18", "34"})
    expect_error([&] { with({{"model.sliding_window", window}, {"training.device", "cuda"}}); },
                 {"parallelism.context_parallel_rotate_method = p2p", fmt::format("model.sliding_window = {}", window),
                  "training.seq_len = 64", "parallelism.context_parallel_degree = 2", "chunks of 16 positions",
                  "single query", "allgather"});
  // 50 - 2 = 3 x 16 would be chunks 4 apart, past the farthest pair (3 apart).
  EXPECT_EQ(with({{"model.sliding_window", "50"}, {"training.device", "cuda"}}).model.sliding_window, 50);
  expect_error([&] { with({{"model.sliding_window", "4"}, {"data.source", "sft"}, {"data.path", "/d/x"}}); },
               {"parallelism.context_parallel_rotate_method = p2p", "data.source = sft", "packed examples"});
}

TEST(ConfigValidate, SequenceMustFitTheModel) {
  expect_error([] { load({{"training.seq_len", "512"}}); },
               {"training.seq_len = 512 (command line) exceeds model.max_seq_len = 256"});
}

TEST(ConfigValidate, RopeScalingFactorsMustBeOrdered) {
  expect_error([] { load({{"model.rope_scaling.enabled", "true"}, {"model.rope_scaling.high_freq_factor", "1"}}); },
               {"model.rope_scaling.high_freq_factor = 1 (command line) must be greater than "
                "model.rope_scaling.low_freq_factor = 1"});
}

TEST(ConfigValidate, IndexedDataNeedsAPathAndSplitMustParse) {
  expect_error([] { load({{"data.source", "indexed"}}); }, {"data.source = indexed (command line) needs data.path"});
  expect_error([] { load({{"data.split", "90,x"}}); }, {"command line", "data.split expects", "got '90,x'"});
  expect_error([] { load({{"data.split", "0,0,0"}}); }, {"data.split"});
  expect_error([] { load({{"data.split", "1,1,1,1"}}); }, {"data.split"});
  EXPECT_EQ(load({{"data.split", "98,2"}}).data.split, "98,2");
}

TEST(ConfigValidate, ValidationPathIsForIndexedData) {
  expect_error([] { load({{"data.validation_path", "/d/v"}}); },
               {"data.validation_path = /d/v (command line) is for data.source indexed, but data.source = synthetic"});
  expect_error([] { load({{"data.source", "sft"}, {"data.path", "/d/x"}, {"data.validation_path", "/d/v"}}); },
               {"data.validation_path", "data.source = sft"});
  EXPECT_EQ(load({}).data.validation_path, "");
  EXPECT_EQ(
      load({{"data.source", "indexed"}, {"data.path", "/d/x"}, {"data.validation_path", "/d/v"}}).data.validation_path,
      "/d/v");
}

TEST(ConfigValidate, SftDataNeedsOnePathAndKnownPacking) {
  expect_error([] { load({{"data.source", "sft"}}); }, {"data.source = sft (command line) needs data.path"});
  expect_error([] { load({{"data.source", "sft"}, {"data.path", "/d/x"}, {"data.blend", "1 /a"}}); },
               {"data.source = sft", "data.blend is for indexed data"});
  expect_error([] { load({{"data.source", "sft"}, {"data.blend", "1 /a"}}); }, {"needs data.path"});
  expect_error([] { load({{"data.packing", "squeeze"}}); }, {"data.packing", "packed, padded"});
  expect_error([] { load({{"data.overlong", "wrap"}}); }, {"data.overlong", "truncate, drop"});
  const auto config = load({{"data.source", "sft"}, {"data.path", "/d/x"}, {"data.packing", "padded"}});
  EXPECT_EQ(config.data.packing, "padded");
  EXPECT_EQ(config.data.overlong, "truncate");
}

TEST(ConfigValidate, GovReportNpyDataNeedsItsFolder) {
  expect_error([] { load({{"data.source", "govreport_npy"}}); },
               {"data.source = govreport_npy (command line) needs data.path", "train.npy and validation.npy"});
  expect_error([] { load({{"data.source", "govreport_npy"}, {"data.blend", "1 /a"}}); }, {"needs data.path"});
  EXPECT_EQ(load({{"data.source", "govreport_npy"}, {"data.path", "/d/gov"}}).data.path, "/d/gov");
}

TEST(ConfigValidate, GemmTuningCacheIsADirectoryOrOff) {
  for (const char* word : {"false", "no", "True", "OFF", "none"})
    expect_error([&] { load({{"training.gemm_tuning_cache", word}}); },
                 {"training.gemm_tuning_cache = ", "(command line) expects a directory", "or off to keep no cache"});
  EXPECT_EQ(load({{"training.gemm_tuning_cache", "off"}}).training.gemm_tuning_cache, "off");
  EXPECT_EQ(load({{"training.gemm_tuning_cache", "/scratch/forge"}}).training.gemm_tuning_cache, "/scratch/forge");
  EXPECT_EQ(load({}).training.gemm_tuning_cache, "");
}

TEST(ConfigValidate, MinLrMustNotExceedLr) {
  expect_error([] { load({{"lr_scheduler.min_lr", "1"}}); },
               {"lr_scheduler.min_lr = 1 (command line) must not exceed optimizer.lr = 0.005 (default value)"});
}

TEST(ConfigValidate, DefaultsOutOfRangeAreReportedAsDefaults) {
  ExperimentConfig config;  // ModelConfig's defaults describe no model: vocab_size 0
  expect_error([&] { validate_experiment(config); }, {"default value", "model.vocab_size expects an integer in [1, 2147483647]"});
}

TEST(ConfigValidate, BatchDerivesAccumulationFromGlobal) {
  const ExperimentConfig config =
      load({{"training.local_batch_size", "4"}, {"training.global_batch_size", "32"},
            {"parallelism.data_parallel_shard_degree", "2"}});
  EXPECT_EQ(config.training.gradient_accumulation_steps, 4);
  EXPECT_EQ(config.training.global_batch_size, 32);
}

TEST(ConfigValidate, BatchDerivesGlobalFromAccumulation) {
  const ExperimentConfig config =
      load({{"training.local_batch_size", "6"}, {"training.gradient_accumulation_steps", "3"}});
  EXPECT_EQ(config.training.global_batch_size, 18);
  EXPECT_EQ(config.training.gradient_accumulation_steps, 3);
  const ExperimentConfig neither = load({{"training.local_batch_size", "6"}});
  EXPECT_EQ(neither.training.gradient_accumulation_steps, 1);
  EXPECT_EQ(neither.training.global_batch_size, 6);
}

TEST(ConfigValidate, BatchSizesMustAgree) {
  expect_error(
      [] {
        load({{"training.local_batch_size", "4"}, {"training.global_batch_size", "64"},
              {"training.gradient_accumulation_steps", "8"}});
      },
      {"training.global_batch_size = 64 (command line) must equal", "4 × 8 × 1 = 32"});
  expect_error([] { load({{"training.local_batch_size", "4"}, {"training.global_batch_size", "10"}}); },
               {"training.global_batch_size = 10 (command line) must be a multiple of", "4 × 1 = 4"});
  expect_error(
      [] {
        load({{"training.local_batch_size", "4"}, {"training.global_batch_size", "4"},
              {"parallelism.data_parallel_shard_degree", "2"}});
      },
      {"training.global_batch_size = 4", "4 × 2 = 8"});
}

TEST(ConfigValidate, CrossKeyErrorsQuoteYamlOrigins) {
  ScratchDir dir;
  const std::string experiment = dir.write("exp.yaml", "training:\n  local_batch_size: 4\n  global_batch_size: 6\n");
  expect_error([&] { load_experiment(experiment, {}); }, {"training.global_batch_size = 6 (", "exp.yaml:3)"});
}

}  // namespace
}  // namespace forge
