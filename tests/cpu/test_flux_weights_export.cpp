// FLUX's diffusers export planned and written in pieces (NOTE [FLUX export in pieces] in
// ckpt/flux_weights_export.h): one writer of the plan writes what write_safetensors writes
// for the diffusers tensors in name order (the one-file export as it was written before it
// was planned), in fp32, bf16 and fp16; cut into shards, files named as diffusers names
// them; the FSDP chunks of 2, 3 and 5 ranks (flux_fsdp_layout), each written by its own
// writer, leave the same bytes as one writer of every parameter whole, each element written
// once; FLUX.1-dev's is cut into 3 files in bf16, 5 in fp32; save_flux_weights' sharded export reads back bit for bit through read_flux_weights;
// an export abandoned before commit() leaves the target's old contents and no temporary.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "ckpt/flux_weights.h"
#include "ckpt/flux_weights_export.h"
#include "ckpt/hf_export.h"
#include "core/rng.h"
#include "distributed/flux_fsdp.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

FluxConfig debug_config() { return flux_preset("flux-debug"); }

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every file of a directory, by name.
std::map<std::string, std::string> files_of(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) files[entry.path().filename().string()] = bytes_of(entry.path());
  return files;
}

// The parameters' values (the flat buffer's gaps between them stay 0).
void fill(FluxParameters& params, uint64_t seed) {
  Rng rng(seed);
  for (const Tensor& t : params.tensors())
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal() * 0.5);
}

int64_t parameter_count(const FluxParameters& params) {
  int64_t n = 0;
  for (const Tensor& t : params.tensors()) n += t.numel();
  return n;
}

std::span<const float> values_of(const Tensor& t) { return {t.data<float>(), static_cast<size_t>(t.numel())}; }

// One writer of the plan, every parameter whole.
std::map<std::string, std::string> written_whole(const FluxParameters& params, const HfExportPlan& plan,
                                                 const std::string& dir) {
  fs::create_directories(dir);
  plan.create_files(dir);
  HfExportWriter writer(plan, dir);
  for (size_t i = 0; i < params.specs().size(); ++i) writer.write(i, values_of(params.tensors()[i]));
  writer.close();
  EXPECT_EQ(writer.written(), plan.numel());
  return files_of(dir);
}

TEST(FluxWeightsExport, OneFileIsWriteSafetensorsOfTheDiffusersTensorsInNameOrder) {
  const FluxConfig config = debug_config();
  FluxParameters params(config);
  fill(params, 3);
  for (SafetensorsDType dtype : {SafetensorsDType::F32, SafetensorsDType::BF16, SafetensorsDType::F16}) {
    SCOPED_TRACE(safetensors_dtype_name(dtype));
    TempDir dir;
    // The diffusers tensors, each a parameter's rows, by name.
    std::map<std::string, std::pair<Shape, const float*>> tensors;
    for (size_t i = 0; i < params.specs().size(); ++i) {
      const ParamSpec& spec = params.specs()[i];
      const int64_t row = shape_numel(spec.shape) / spec.shape[0];
      int64_t first = 0;
      for (const HfTensor& t : spec.hf_tensors) {
        Shape shape = spec.shape;
        shape[0] = t.rows;
        tensors[t.name] = {shape, params.tensors()[i].data<float>() + first * row};
        first += t.rows;
      }
    }
    std::vector<SafetensorsTensorRef> refs;
    for (const auto& [name, t] : tensors) refs.push_back({name, t.first, t.second});
    write_safetensors(dir.file("reference.safetensors"), refs, dtype, {{"format", "pt"}});
    const HfExportPlan plan = flux_weights_plan(config, dtype);
    ASSERT_EQ(plan.files().size(), 1u);
    EXPECT_EQ(plan.files()[0].name, "diffusion_pytorch_model.safetensors");
    EXPECT_EQ(plan.numel(), parameter_count(params));
    const auto got = written_whole(params, plan, dir.file("planned"));
    EXPECT_TRUE(got.at("diffusion_pytorch_model.safetensors") == bytes_of(dir.file("reference.safetensors")));
  }
}

// FLUX.1-dev's export (planned, nothing allocated) is cut as its published transformer/ is:
// 3 files in bf16; 5 in fp32.
TEST(FluxWeightsExport, FluxDevIsThreeShardsInBf16AndFiveInFp32) {
  const FluxConfig dev = flux_preset("flux1-dev");
  const HfExportPlan bf16 = flux_weights_plan(dev, SafetensorsDType::BF16);
  const HfExportPlan fp32 = flux_weights_plan(dev, SafetensorsDType::F32);
  EXPECT_EQ(bf16.numel(), 11901408320);
  EXPECT_EQ(bf16.files().size(), 3u);
  EXPECT_EQ(fp32.files().size(), 5u);
  for (const HfExportFile& f : fp32.files()) EXPECT_LE(f.bytes, kDiffusersMaxShardBytes + (1u << 20)) << f.name;
}

TEST(FluxWeightsExport, FsdpChunksOfEveryRankWriteTheOneWritersBytes) {
  const FluxConfig config = debug_config();
  FluxParameters params(config);
  fill(params, 5);
  for (uint64_t max_bytes : {kDiffusersMaxShardBytes, uint64_t{20000}})
    for (int world : {2, 3, 5}) {
      SCOPED_TRACE(fmt::format("{} ranks, shards of at most {} bytes", world, max_bytes));
      TempDir dir;
      const HfExportPlan plan = flux_weights_plan(config, SafetensorsDType::BF16, max_bytes);
      if (max_bytes < kDiffusersMaxShardBytes) {
        ASSERT_GT(plan.files().size(), 2u);
        EXPECT_EQ(plan.files()[0].name,
                  fmt::format("diffusion_pytorch_model-00001-of-{:05d}.safetensors", plan.files().size()));
        EXPECT_EQ(plan.index_name(), "diffusion_pytorch_model.safetensors.index.json");
      }
      const auto want = written_whole(params, plan, dir.file("whole"));
      const std::string pieces = dir.file("pieces");
      fs::create_directories(pieces);
      plan.create_files(pieces);
      int64_t written = 0;
      for (int rank = world - 1; rank >= 0; --rank) {  // any order
        const FsdpLayout layout = flux_fsdp_layout(config, world, rank);
        HfExportWriter writer(plan, pieces);
        for (const FsdpSegment& s : layout.segments()) {
          const auto spec = static_cast<size_t>(s.spec);
          writer.write(spec, values_of(params.tensors()[spec]).subspan(s.param_begin, s.numel), s.param_begin);
        }
        writer.close();
        EXPECT_LT(writer.written(), plan.numel());  // no rank writes the whole model
        written += writer.written();
      }
      EXPECT_EQ(written, plan.numel());
      EXPECT_TRUE(files_of(pieces) == want);
    }
}

TEST(FluxWeightsExport, ShardedExportCommitsItsIndexAndReadsBackBitForBit) {
  const FluxConfig config = debug_config();
  FluxParameters params(config);
  fill(params, 7);
  TempDir dir;
  const std::string target = dir.file("diffusers");
  {
    FluxWeightsExport out(target, config, SafetensorsDType::F32, hf_export_temporary_path(target, 77), 30000);
    EXPECT_EQ(out.temporary_path(), target + ".tmp-export-77");
    HfExportWriter writer(out.plan(), out.temporary_path());
    for (size_t i = 0; i < params.specs().size(); ++i) writer.write(i, values_of(params.tensors()[i]));
    writer.close();
    out.commit();
  }
  EXPECT_FALSE(fs::exists(target + ".tmp-export-77"));
  const auto files = files_of(target);
  ASSERT_TRUE(files.count("config.json"));
  ASSERT_TRUE(files.count("diffusion_pytorch_model.safetensors.index.json"));
  const nlohmann::json index = nlohmann::json::parse(files.at("diffusion_pytorch_model.safetensors.index.json"));
  std::set<std::string> shards, names;
  for (const auto& [name, file] : index["weight_map"].items()) {
    shards.insert(file.get<std::string>());
    names.insert(name);
  }
  EXPECT_EQ(shards.size() + 2, files.size());  // the shards, the index and config.json
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), parameter_count(params) * 4);
  EXPECT_TRUE(names.count("transformer_blocks.0.attn.to_q.weight"));
  FluxParameters back(config);
  load_flux_weights(target, back);
  for (size_t i = 0; i < params.tensors().size(); ++i)
    EXPECT_EQ(std::memcmp(back.tensors()[i].data<float>(), params.tensors()[i].data<float>(),
                          static_cast<size_t>(params.tensors()[i].numel()) * sizeof(float)),
              0)
        << params.specs()[i].name;
}

TEST(FluxWeightsExport, SaveFluxWeightsReplacesAnOldExportAndAnAbandonedOneLeavesIt) {
  const FluxConfig config = debug_config();
  FluxParameters first(config), second(config);
  fill(first, 1);
  fill(second, 2);
  TempDir dir;
  const std::string target = dir.file("diffusers");
  save_flux_weights(target, first, FluxWeightLayout::Diffusers, SafetensorsDType::BF16);
  const auto old = files_of(target);
  EXPECT_EQ(old.size(), 2u);  // diffusion_pytorch_model.safetensors and config.json
  {
    // A failure between the files' creation and commit(): the export is destroyed uncommitted.
    FluxWeightsExport out(target, config, SafetensorsDType::BF16, hf_export_temporary_path(target, 5));
    HfExportWriter writer(out.plan(), out.temporary_path());
    writer.write(0, values_of(second.tensors()[0]));
    writer.close();
  }
  EXPECT_FALSE(fs::exists(target + ".tmp-export-5"));
  EXPECT_TRUE(files_of(target) == old);
  save_flux_weights(target, second, FluxWeightLayout::Diffusers, SafetensorsDType::BF16);
  EXPECT_FALSE(files_of(target) == old);
  FluxParameters back(config);
  load_flux_weights(target, back);
  // bf16 of the second weights.
  int64_t far = 0;
  for (size_t k = 0; k < back.tensors().size(); ++k) {
    const float* want = second.tensors()[k].data<float>();
    const float* got = back.tensors()[k].data<float>();
    for (int64_t i = 0; i < back.tensors()[k].numel(); ++i)
      far += std::abs(got[i] - want[i]) > 1e-2f * std::abs(want[i]) + 1e-6f;
  }
  EXPECT_EQ(far, 0);
  // A file where the directory would go is refused, naming it.
  std::ofstream(dir.file("a-file")) << "x";
  try {
    FluxWeightsExport out(dir.file("a-file"), config, SafetensorsDType::BF16);
    ADD_FAILURE() << "a file as the target was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("a-file"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge
