// The Hugging Face export written in pieces (NOTE [Export written in pieces] in
// ckpt/hf_export_writer.h): the planned files are byte for byte what write_safetensors
// writes for the model's Hugging Face tensors cut as save_pretrained cuts them (Llama, and
// a DeepSeek-V3 shape with reordered rotary rows, an fp32 routing bias and empty shared
// experts; fp32, bf16 and fp16; one file and shards); writers that each write a part of
// the values (uneven runs in any order; pipeline stages; chunks of tensor-parallel shards,
// the replicated norms by one rank) leave the same bytes as one writer of every parameter
// whole, and an export committed from them is save_hf_model's, file for file. The import
// side: a pipeline rank reads only its stages' tensors but checks every one.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "ckpt/hf_export.h"
#include "ckpt/hf_export_writer.h"
#include "ckpt/hf_import.h"
#include "ckpt/safetensors.h"
#include "core/rng.h"
#include "expect_error.h"
#include "model/pipeline.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

// 4 blocks; every size divisible by 2 tensor-parallel ranks.
ModelConfig llama() {
  ModelConfig c;
  c.name = "tiny";
  c.vocab_size = 40;
  c.hidden_size = 24;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 40;
  c.max_seq_len = 64;
  return c;
}

// Multi-head Latent Attention (rotary rows reordered on export), sigmoid routing (a bias
// stored in fp32), no shared experts (the empty tensors transformers writes), a dense block.
ModelConfig deepseek_v3() {
  ModelConfig c = llama();
  c.num_layers = 3;
  c.num_kv_heads = 4;
  c.ffn_hidden_size = 32;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_ffn_hidden_size = 8;
  c.num_shared_experts = 0;
  c.first_dense_layers = 1;
  c.router_score_function = "sigmoid";
  c.router_normalize_topk = true;
  c.kv_lora_rank = 8;
  c.q_lora_rank = 12;
  c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 8;  // a row order that is not its own inverse
  c.v_head_dim = 6;
  return c;
}

// Every value distinct and not a round number (norm weights included).
void fill(FlatParameters& p, uint64_t seed) {
  Rng rng(seed);
  float* x = p.flat().data<float>();
  for (int64_t i = 0; i < p.flat().numel(); ++i) x[i] = static_cast<float>(rng.uniform() * 2.0 - 1.0);
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// What the export wrote before it was planned: every parameter's parts (DeepSeek's rows in
// the stored order) as SafetensorsTensorRefs, then the empty ones, cut into consecutive
// runs of at most max_bytes (a larger tensor alone), each written by write_safetensors.
std::map<std::string, std::string> reference_files(const FlatParameters& params, SafetensorsDType dtype,
                                                   uint64_t max_bytes, const std::string& dir) {
  std::vector<SafetensorsTensorRef> refs;
  for (size_t i = 0; i < params.specs().size(); ++i)
    for (HfPart& part : hf_parts(params.specs()[i]))
      refs.push_back({part.name, part.shape, params.tensors()[i].data<float>() + part.offset, std::move(part.row_order),
                      part.keep_fp32 ? std::optional(SafetensorsDType::F32) : std::nullopt});
  for (const HfPart& part : hf_empty_parts(params.config())) refs.push_back({part.name, part.shape, nullptr});
  std::vector<std::vector<SafetensorsTensorRef>> shards(1);
  uint64_t bytes = 0;
  for (const auto& t : refs) {
    const uint64_t size =
        static_cast<uint64_t>(shape_numel(t.shape)) * safetensors_dtype_size(t.stored.value_or(dtype));
    if (!shards.back().empty() && bytes + size > max_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(t);
    bytes += size;
  }
  std::map<std::string, std::string> files;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shards.size() == 1
                                 ? "model.safetensors"
                                 : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    write_safetensors(dir + "/" + name, shards[s], dtype, {{"format", "pt"}});
    files[name] = bytes_of(dir + "/" + name);
  }
  return files;
}

std::map<std::string, std::string> planned_files(const HfExportPlan& plan, const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const HfExportFile& f : plan.files()) files[f.name] = bytes_of(dir + "/" + f.name);
  return files;
}

std::span<const float> values_of(const Tensor& t) { return {t.data<float>(), static_cast<size_t>(t.numel())}; }

// One writer, every parameter whole.
std::map<std::string, std::string> written_whole(const FlatParameters& params, const HfExportPlan& plan,
                                                 const std::string& dir) {
  std::filesystem::create_directories(dir);
  plan.create_files(dir);
  HfExportWriter writer(plan, dir);
  for (size_t i = 0; i < params.specs().size(); ++i) writer.write(i, values_of(params.tensors()[i]));
  writer.close();
  EXPECT_EQ(writer.written(), plan.numel());
  return planned_files(plan, dir);
}

// checkpoint.export_max_shard_size as transformers' convert_file_size_to_int reads it.
TEST(HfExportWriter, MaxShardSizeReadsAsSavePretrainedsMaxShardSize) {
  EXPECT_EQ(export_max_shard_bytes("", 5'000'000'000), 5'000'000'000u);
  EXPECT_EQ(export_max_shard_bytes("", 7), 7u);
  EXPECT_EQ(export_max_shard_bytes("123", 7), 123u);
  EXPECT_EQ(export_max_shard_bytes("5GB", 7), 5'000'000'000u);
  EXPECT_EQ(export_max_shard_bytes("500MB", 7), 500'000'000u);
  EXPECT_EQ(export_max_shard_bytes("20KB", 7), 20'000u);
  EXPECT_EQ(export_max_shard_bytes("4GiB", 7), 4ull << 30);
  EXPECT_EQ(export_max_shard_bytes("3MiB", 7), 3ull << 20);
  EXPECT_EQ(export_max_shard_bytes("2KiB", 7), 2048u);
  EXPECT_EQ(export_max_shard_bytes("8Gb", 7), 1'000'000'000u);  // bits
  EXPECT_EQ(export_max_shard_bytes("80Mb", 7), 10'000'000u);
  EXPECT_EQ(export_max_shard_bytes("16Kb", 7), 2'000u);
  expect_error([] { export_max_shard_bytes("5gb", 7, "the.key"); }, {"the.key", "'5gb'", "ambiguous", "GB", "Gb"});
  expect_error([] { export_max_shard_bytes("5mb", 7); }, {"checkpoint.export_max_shard_size", "MB"});
  for (const char* bad : {"5 GB", "GB", "5TB", "-1", "1.5GB", "5G", "99999999999999GB"})
    expect_error([&] { export_max_shard_bytes(bad, 7); }, {"checkpoint.export_max_shard_size", "expected a whole number"});
  expect_error([] { export_max_shard_bytes("0", 7); }, {"at least one byte"});
  expect_error([] { export_max_shard_bytes("0GiB", 7); }, {"at least one byte"});
}

TEST(HfExportWriter, PlannedFilesAreWriteSafetensorsOfTheModelsTensors) {
  for (const ModelConfig& config : {llama(), deepseek_v3()})
    for (SafetensorsDType dtype : {SafetensorsDType::F32, SafetensorsDType::BF16, SafetensorsDType::F16})
      for (uint64_t max_bytes : {uint64_t{5'000'000'000}, uint64_t{3000}}) {
        SCOPED_TRACE(
            fmt::format("{} {} max {}", config.mla() ? "deepseek" : "llama", safetensors_dtype_name(dtype), max_bytes));
        TempDir dir;
        FlatParameters params(config);
        fill(params, 7);
        std::filesystem::create_directories(dir.file("reference"));
        const auto want = reference_files(params, dtype, max_bytes, dir.file("reference"));
        const HfExportPlan plan(config, dtype, max_bytes, true);
        EXPECT_EQ(plan.numel(), params.flat().numel());
        EXPECT_EQ(plan.files().size() > 1, max_bytes < 5'000'000'000);
        const auto got = written_whole(params, plan, dir.file("planned"));
        ASSERT_EQ(got.size(), want.size());
        for (const auto& [name, bytes] : want) EXPECT_TRUE(got.at(name) == bytes) << name;
      }
}

TEST(HfExportWriter, RunsInAnyOrderFromSeveralWritersWriteTheSameBytes) {
  for (const ModelConfig& config : {llama(), deepseek_v3()}) {
    TempDir dir;
    FlatParameters params(config);
    fill(params, 11);
    const HfExportPlan plan(config, SafetensorsDType::BF16, 2500, true);
    const auto want = written_whole(params, plan, dir.file("whole"));
    // Every parameter cut into runs of 1 to 40 elements, dealt to 3 writers in a shuffled order.
    struct Run {
      size_t spec;
      int64_t begin, count;
    };
    std::vector<Run> runs;
    Rng rng(3);
    for (size_t i = 0; i < params.specs().size(); ++i)
      for (int64_t at = 0, n = params.tensors()[i].numel(); at < n;) {
        const int64_t count = std::min<int64_t>(n - at, 1 + static_cast<int64_t>(rng.below(40)));
        runs.push_back({i, at, count});
        at += count;
      }
    for (size_t k = runs.size(); k > 1; --k) std::swap(runs[k - 1], runs[rng.below(k)]);
    const std::string pieces = dir.file("pieces");
    std::filesystem::create_directories(pieces);
    plan.create_files(pieces);
    int64_t written = 0;
    for (size_t w = 0; w < 3; ++w) {
      HfExportWriter writer(plan, pieces);
      for (size_t k = w; k < runs.size(); k += 3)
        writer.write(runs[k].spec, values_of(params.tensors()[runs[k].spec]).subspan(runs[k].begin, runs[k].count),
                     runs[k].begin);
      writer.close();
      written += writer.written();
    }
    EXPECT_EQ(written, plan.numel());
    EXPECT_TRUE(planned_files(plan, pieces) == want);
  }
}

// A pipeline of 2 stages, each 2 tensor-parallel ranks whose shards 2 FSDP ranks split in
// chunks: every (stage, tensor-parallel rank, FSDP rank) writes its chunk of its shards of
// its stages' parameters, the replicated norms only on tensor-parallel rank 0.
TEST(HfExportWriter, ChunksOfTensorParallelShardsOfPipelineStagesWriteTheSameBytes) {
  const ModelConfig config = llama();
  TempDir dir;
  FlatParameters params(config);
  fill(params, 5);
  const HfExportPlan plan(config, SafetensorsDType::F32, 4000, true);
  const auto want = written_whole(params, plan, dir.file("whole"));
  const std::string pieces = dir.file("pieces");
  std::filesystem::create_directories(pieces);
  plan.create_files(pieces);
  const std::vector<ParamSpec> specs = parameter_specs(config);
  int64_t written = 0;
  for (int stage = 0; stage < 2; ++stage) {
    const std::vector<PipelineStage> stages = {pipeline_stage(config, 2, 1, stage, 0)};
    std::set<std::string> held;
    for (const ParamSpec& spec : pipeline_stage_specs(specs, stages)) held.insert(spec.name);
    for (int t = 0; t < 2; ++t) {
      const TensorParallelShard shard{t, 2};
      for (int chunk = 0; chunk < 2; ++chunk) {
        HfExportWriter writer(plan, pieces);
        for (size_t i = 0; i < specs.size(); ++i) {
          if (!held.count(specs[i].name)) continue;
          if (t != 0 && specs[i].tensor_parallel == TensorParallelSplit::Replicated) continue;
          // The shard's values: the whole parameter's at its runs' places.
          std::vector<float> local;
          for (const ShardRun& run : tensor_parallel_runs(specs[i], shard)) {
            const float* from = params.tensors()[i].data<float>() + run.full_begin;
            local.insert(local.end(), from, from + run.count);
          }
          const size_t half = local.size() / 2 + 1, begin = chunk == 0 ? 0 : half;
          const size_t end = chunk == 0 ? half : local.size();
          writer.write(i, std::span<const float>(local).subspan(begin, end - begin), static_cast<int64_t>(begin),
                       shard);
        }
        writer.close();
        written += writer.written();
      }
    }
  }
  EXPECT_EQ(written, plan.numel());
  EXPECT_TRUE(planned_files(plan, pieces) == want);
}

TEST(HfExportWriter, AnExportFromSeveralWritersIsSaveHfModels) {
  const ModelConfig config = llama();
  TempDir dir;
  FlatParameters params(config);
  fill(params, 9);
  HfExportOptions options;
  options.dtype = SafetensorsDType::BF16;
  options.max_shard_bytes = 3000;
  save_hf_model(dir.file("one"), params, options);
  const std::string temporary = hf_export_temporary_path(dir.file("two"), 4321);
  EXPECT_EQ(temporary, dir.file("two") + ".tmp-export-4321");
  {
    HfExportDirectory out(dir.file("two/"), config, options, temporary);
    EXPECT_TRUE(std::filesystem::is_directory(temporary));
    const HfExportPlan plan = hf_export_plan(config, options);
    HfExportWriter first(plan, temporary), second(plan, temporary);
    for (size_t i = 0; i < params.specs().size(); ++i)
      (i % 2 ? first : second).write(i, values_of(params.tensors()[i]));
    first.close();
    second.close();
    out.commit();
  }
  EXPECT_FALSE(std::filesystem::exists(temporary));
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.file("one"))) {
    const std::string name = entry.path().filename().string();
    names.insert(name);
    EXPECT_TRUE(bytes_of(entry.path().string()) == bytes_of(dir.file("two/" + name))) << name;
  }
  EXPECT_TRUE(names.count("model.safetensors.index.json"));
  EXPECT_EQ(static_cast<size_t>(std::distance(std::filesystem::directory_iterator(dir.file("two")),
                                              std::filesystem::directory_iterator())),
            names.size());
  // Abandoned before commit(): nothing at the target, no temporary left.
  { HfExportDirectory out(dir.file("three"), config, options, hf_export_temporary_path(dir.file("three"), 1)); }
  EXPECT_FALSE(std::filesystem::exists(dir.file("three")));
  EXPECT_FALSE(std::filesystem::exists(hf_export_temporary_path(dir.file("three"), 1)));
}

TEST(HfImportStages, APipelineRankReadsItsStagesAndChecksEveryTensor) {
  const ModelConfig config = llama();
  TempDir dir;
  FlatParameters params(config);
  fill(params, 13);
  save_hf_model(dir.file("model"), params);
  const std::vector<ParamSpec> specs = parameter_specs(config);
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<PipelineStage> stages = {pipeline_stage(config, 2, 1, rank, 0)};
    std::set<std::string> want;
    for (const ParamSpec& spec : pipeline_stage_specs(specs, stages)) want.insert(spec.name);
    std::set<std::string> got;
    for_each_hf_parameter(
        dir.file("model"), config,
        [&](size_t spec, const Tensor& values) {
          got.insert(specs[spec].name);
          EXPECT_EQ(0, std::memcmp(values.raw(), params.tensors()[spec].raw(), values.nbytes())) << specs[spec].name;
        },
        {}, stages);
    EXPECT_EQ(got, want);
    EXPECT_EQ(got.count("embedding.weight"), rank == 0 ? 1u : 0u);
    EXPECT_EQ(got.count("output.weight"), rank == 1 ? 1u : 0u);
  }
  // A tensor of stage 1 missing: stage 0's rank refuses the model too.
  std::vector<SafetensorsTensorRef> kept;
  for (size_t i = 0; i < specs.size(); ++i)
    for (HfPart& part : hf_parts(specs[i]))
      if (part.name != "model.layers.3.mlp.down_proj.weight")
        kept.push_back({part.name, part.shape, params.tensors()[i].data<float>() + part.offset});
  write_safetensors(dir.file("model/model.safetensors"), kept, SafetensorsDType::F32, {{"format", "pt"}});
  const std::string e = error_of([&] {
    for_each_hf_parameter(dir.file("model"), config, [](size_t, const Tensor&) {}, {},
                          {pipeline_stage(config, 2, 1, 0, 0)});
  });
  EXPECT_NE(e.find("no tensor 'model.layers.3.mlp.down_proj.weight'"), std::string::npos) << e;
}

}  // namespace
}  // namespace forge
