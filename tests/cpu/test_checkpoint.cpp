// Checkpoints (ckpt/checkpoint.h): what is saved comes back exactly, at any world size;
// keep_latest_k and unfinished saves behave; every kind of damage or mismatch is an error
// naming the file and the tensor.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "core/rng.h"
#include "model/parameters.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

ModelConfig tiny_model() {
  ModelConfig m;
  m.name = "ckpt-test";
  m.vocab_size = 16;
  m.hidden_size = 8;
  m.num_layers = 2;
  m.num_heads = 2;
  m.num_kv_heads = 1;
  m.ffn_hidden_size = 16;
  m.rope_scaling.enabled = true;
  m.rope_scaling.factor = 4.0;
  return m;
}

int64_t numel_of(const ModelConfig& m) {
  int64_t n = 0;
  for (const ParamSpec& s : parameter_specs(m)) n += shape_numel(s.shape);
  return n;
}

// The three flat vectors of a training state, filled with distinct values.
struct FlatVectors {
  std::vector<float> params, m, v;

  explicit FlatVectors(int64_t numel, uint64_t seed) {
    Rng rng(seed);
    for (auto* vec : {&params, &m, &v})
      for (int64_t i = 0; i < numel; ++i) vec->push_back(static_cast<float>(rng.normal()));
  }
  const std::vector<float>& of(FlatState state) const {
    return state == FlatState::Param ? params : state == FlatState::ExpAvg ? m : v;
  }
};

TrainingState state_at(int64_t step) {
  TrainingState s;
  s.step = step;
  s.data_position = step * 8;
  s.seed = 0xFEDCBA9876543210ull;
  s.lr_schedule_steps = 100;
  s.optimizer.lr = 3e-4;
  s.optimizer.beta2 = 0.999;
  s.optimizer_step = step;
  return s;
}

// Saves `data` as if by `world` ranks, each handing in its own range.
std::string save_as_world(const std::string& folder, const ModelConfig& model, const FlatVectors& data, int world,
                          int64_t step, int64_t keep_latest_k = 0) {
  std::vector<ShardData> shards;
  for (const ShardRange& r : shard_ranges(static_cast<int64_t>(data.params.size()), world))
    shards.push_back({r, data.params.data() + r.begin, data.m.data() + r.begin, data.v.data() + r.begin});
  return save_checkpoint(folder, model, "model:\n  name: ckpt-test\n", state_at(step), shards, keep_latest_k);
}

// Loads every rank's range of every vector as `world` ranks would, and checks them.
void expect_loads_as_world(const std::string& dir, const ModelConfig& model, const FlatVectors& expected, int world) {
  Checkpoint ck = open_checkpoint(dir);
  check_checkpoint_model(ck, model, true);
  for (FlatState state : kFlatStates) {
    const std::vector<float>& want = expected.of(state);
    for (const ShardRange& r : shard_ranges(static_cast<int64_t>(want.size()), world)) {
      std::vector<float> got(static_cast<size_t>(r.size()));
      read_flat_range(ck, state, r.begin, got);
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + r.begin))
          << flat_state_name(state) << " [" << r.begin << ", " << r.end << ") at world " << world;
    }
  }
}

// Opens, checks against the model and reads everything: where any damage shows up.
void load_everything(const std::string& dir, const ModelConfig& model) {
  Checkpoint ck = open_checkpoint(dir);
  check_checkpoint_model(ck, model, true);
  std::vector<float> out(static_cast<size_t>(ck.metadata.flat_numel));
  for (FlatState state : kFlatStates) read_flat_range(ck, state, 0, out);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a forge::Error";
  return "";
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Where a tensor starts in its shard file.
TensorPiece first_piece(const std::string& dir, const std::string& name, FlatState state) {
  const Checkpoint ck = open_checkpoint(dir);
  for (const TensorRecord& rec : ck.metadata.tensors)
    if (rec.name == name && rec.state == state) return rec.pieces.front();
  throw std::runtime_error("no tensor " + name);
}

TEST(CheckpointRoundTrip, EverythingComesBack) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  const FlatVectors data(numel_of(model), 1);
  const std::string dir = save_as_world(tmp.file("ckpt"), model, data, 1, 7);
  EXPECT_EQ(dir, tmp.file("ckpt") + "/step-7");
  expect_loads_as_world(dir, model, data, 1);

  const CheckpointMetadata md = open_checkpoint(dir).metadata;
  const TrainingState want = state_at(7);
  EXPECT_EQ(md.training.step, 7);
  EXPECT_EQ(md.training.data_position, want.data_position);
  EXPECT_EQ(md.training.seed, want.seed);
  EXPECT_EQ(md.training.lr_schedule_steps, 100);
  EXPECT_EQ(md.training.optimizer.lr, want.optimizer.lr);
  EXPECT_EQ(md.training.optimizer.beta2, want.optimizer.beta2);
  EXPECT_EQ(md.training.optimizer_step, 7);
  EXPECT_EQ(md.experiment_yaml, "model:\n  name: ckpt-test\n");
  EXPECT_EQ(md.model.name, model.name);
  EXPECT_EQ(md.model.hidden_size, model.hidden_size);
  EXPECT_TRUE(md.model.rope_scaling.enabled);
  EXPECT_EQ(md.model.rope_scaling.factor, 4.0);
  EXPECT_EQ(md.shards.size(), 1u);
  EXPECT_EQ(md.tensors.size(), 3 * parameter_specs(model).size());
}

TEST(CheckpointRoundTrip, SavingAStepAgainReplacesIt) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  save_as_world(tmp.file("ckpt"), model, FlatVectors(numel_of(model), 1), 1, 3);
  const FlatVectors second(numel_of(model), 2);
  const std::string dir = save_as_world(tmp.file("ckpt"), model, second, 1, 3);
  expect_loads_as_world(dir, model, second, 1);
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.file("ckpt")), fs::directory_iterator()), 1);
}

TEST(CheckpointReshard, TwoRanksToOneAndBack) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  const FlatVectors data(numel_of(model), 3);
  const std::string two = save_as_world(tmp.file("two"), model, data, 2, 1);
  const CheckpointMetadata md = open_checkpoint(two).metadata;
  ASSERT_EQ(md.shards.size(), 2u);
  bool split_tensor = false;
  for (const TensorRecord& rec : md.tensors) split_tensor |= rec.pieces.size() == 2;
  EXPECT_TRUE(split_tensor) << "the shard boundary should cut a tensor in two";
  expect_loads_as_world(two, model, data, 1);
  expect_loads_as_world(two, model, data, 2);

  const std::string one = save_as_world(tmp.file("one"), model, data, 1, 1);
  expect_loads_as_world(one, model, data, 2);
}

TEST(CheckpointReshard, UnevenRanges) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  const FlatVectors data(numel_of(model), 4);
  ASSERT_NE(numel_of(model) % 3, 0) << "the test wants ranges of unequal size";
  const std::string two = save_as_world(tmp.file("two"), model, data, 2, 1);
  expect_loads_as_world(two, model, data, 3);
  const std::string three = save_as_world(tmp.file("three"), model, data, 3, 1);
  expect_loads_as_world(three, model, data, 2);
  expect_loads_as_world(three, model, data, 5);
}

TEST(CheckpointReshard, ShardRangesTileEvenly) {
  const std::vector<ShardRange> r = shard_ranges(10, 3);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].begin, 0);
  EXPECT_EQ(r[0].end, 4);
  EXPECT_EQ(r[1].end, 7);
  EXPECT_EQ(r[2].end, 10);
}

class CheckpointCorruption : public ::testing::Test {
 protected:
  void SetUp() override { dir = save_as_world(tmp.file("ckpt"), model, FlatVectors(numel_of(model), 5), 2, 4); }
  std::string shard(int rank) const { return dir + "/rank-" + std::to_string(rank) + ".bin"; }
  std::string metadata() const { return dir + "/metadata.json"; }
  std::string load_error() const { return error_of([&] { load_everything(dir, model); }); }

  TempDir tmp;
  ModelConfig model = tiny_model();
  std::string dir;
};

TEST_F(CheckpointCorruption, MissingMetadata) {
  fs::remove(metadata());
  const std::string e = load_error();
  EXPECT_NE(e.find(dir), std::string::npos) << e;
  EXPECT_NE(e.find("no metadata.json"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, MetadataNotJson) {
  write_text(metadata(), "{\"format\": ");
  const std::string e = load_error();
  EXPECT_NE(e.find(metadata()), std::string::npos) << e;
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, MetadataMissingKey) {
  nlohmann::json j = read_json(metadata());
  j["optimizer"].erase("beta1");
  write_text(metadata(), j.dump());
  const std::string e = load_error();
  EXPECT_NE(e.find(metadata()), std::string::npos) << e;
  EXPECT_NE(e.find("optimizer.beta1"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, MetadataWrongType) {
  nlohmann::json j = read_json(metadata());
  j["tensors"][3]["shape"] = "big";
  write_text(metadata(), j.dump());
  const std::string e = load_error();
  EXPECT_NE(e.find("tensors[3].shape"), std::string::npos) << e;
  EXPECT_NE(e.find("an array"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, UnknownFormatVersion) {
  nlohmann::json j = read_json(metadata());
  j["format_version"] = 99;
  write_text(metadata(), j.dump());
  const std::string e = load_error();
  EXPECT_NE(e.find(metadata()), std::string::npos) << e;
  EXPECT_NE(e.find("format_version 99"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, InconsistentPiece) {
  nlohmann::json j = read_json(metadata());
  j["tensors"][1]["pieces"][0]["byte_offset"] = 12;
  write_text(metadata(), j.dump());
  const std::string e = load_error();
  EXPECT_NE(e.find(j["tensors"][1]["name"].get<std::string>()), std::string::npos) << e;
  EXPECT_NE(e.find("inconsistent piece"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, MissingShardFile) {
  fs::remove(shard(1));
  const std::string e = load_error();
  EXPECT_NE(e.find(shard(1)), std::string::npos) << e;
  EXPECT_NE(e.find("lacks its shard file"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, ShortShardFile) {
  fs::resize_file(shard(1), fs::file_size(shard(1)) - 10);
  const std::string e = load_error();
  EXPECT_NE(e.find(shard(1)), std::string::npos) << e;
  EXPECT_NE(e.find("shorter"), std::string::npos) << e;
  EXPECT_NE(e.find("tensor 'output.weight' (exp_avg_sq)"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, FlippedBitFailsTheCrc) {
  const TensorPiece piece = first_piece(dir, "layers.1.mlp.down.weight", FlatState::ExpAvg);
  const std::string file = shard(piece.rank);
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(piece.byte_offset + 5);
  char byte = 0;
  f.read(&byte, 1);
  byte ^= 0x10;
  f.seekp(piece.byte_offset + 5);
  f.write(&byte, 1);
  f.close();
  const std::string e = load_error();
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("tensor 'layers.1.mlp.down.weight' (exp_avg)"), std::string::npos) << e;
  EXPECT_NE(e.find("CRC-32"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, ShapeOfAnotherModel) {
  ModelConfig wider = model;
  wider.ffn_hidden_size = 32;
  const std::string e = error_of([&] { load_everything(dir, wider); });
  EXPECT_NE(e.find(dir), std::string::npos) << e;
  EXPECT_NE(e.find("tensor 'layers.0.mlp.gate_up.weight' (param)"), std::string::npos) << e;
  EXPECT_NE(e.find("[32, 8]"), std::string::npos) << e;
  EXPECT_NE(e.find("[64, 8]"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, MoreLayersThanSaved) {
  ModelConfig deeper = model;
  deeper.num_layers = 3;
  const std::string e = error_of([&] { load_everything(dir, deeper); });
  EXPECT_NE(e.find("no tensor 'layers.2.attn_norm.weight'"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, FewerLayersThanSaved) {
  ModelConfig shallower = model;
  shallower.num_layers = 1;
  const std::string e = error_of([&] { load_everything(dir, shallower); });
  EXPECT_NE(e.find("tensor 'layers.1."), std::string::npos) << e;
  EXPECT_NE(e.find("does not have"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, SameShapesOtherArchitecture) {
  ModelConfig other = model;
  other.rope_theta = 500000.0;
  const std::string e = error_of([&] { load_everything(dir, other); });
  EXPECT_NE(e.find("model.rope_theta"), std::string::npos) << e;
  Checkpoint ck = open_checkpoint(dir);
  EXPECT_NO_THROW(check_checkpoint_model(ck, other, /*same_architecture=*/false));
}

TEST_F(CheckpointCorruption, MissingLoadStep) {
  const std::string e = error_of([&] { find_checkpoint(tmp.file("ckpt"), 9); });
  EXPECT_NE(e.find("load_step 9"), std::string::npos) << e;
  EXPECT_NE(e.find("steps 4"), std::string::npos) << e;
}

TEST(CheckpointKeepLatest, KeepsTheNewestK) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  const FlatVectors data(numel_of(model), 6);
  for (int64_t step = 1; step <= 5; ++step) save_as_world(tmp.file("ckpt"), model, data, 1, step, 2);
  EXPECT_EQ(checkpoint_steps(tmp.file("ckpt")), (std::vector<int64_t>{4, 5}));
  for (const auto& entry : fs::directory_iterator(tmp.file("ckpt")))
    EXPECT_TRUE(entry.path().filename().string().starts_with("step-")) << entry.path();
}

TEST(CheckpointKeepLatest, NeverRemovesTheOneJustSaved) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  const FlatVectors data(numel_of(model), 7);
  for (int64_t step : {4, 5, 3}) save_as_world(tmp.file("ckpt"), model, data, 1, step, 2);
  // Newer checkpoints (a resume with checkpoint.load_step, or damaged ones a resume passed
  // over) are left for the run to replace as it gets there.
  EXPECT_EQ(checkpoint_steps(tmp.file("ckpt")), (std::vector<int64_t>{3, 4, 5}));
  save_as_world(tmp.file("ckpt"), model, data, 1, 4, 2);
  EXPECT_EQ(checkpoint_steps(tmp.file("ckpt")), (std::vector<int64_t>{3, 4, 5}));
  save_as_world(tmp.file("ckpt"), model, data, 1, 6, 2);
  EXPECT_EQ(checkpoint_steps(tmp.file("ckpt")), (std::vector<int64_t>{5, 6}));
}

// NOTE [Choosing the checkpoint to resume]: a damaged checkpoint never takes the place of a
// whole one among the k kept, so the only whole older one survives.
TEST(CheckpointKeepLatest, DamagedCheckpointsDoNotCount) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  const FlatVectors data(numel_of(model), 9);
  for (int64_t step : {1, 2}) save_as_world(tmp.file("ckpt"), model, data, 1, step, 0);
  const std::string damaged = checkpoint_dir(tmp.file("ckpt"), 2) + "/rank-0.bin";
  fs::resize_file(damaged, fs::file_size(damaged) - 4);
  save_as_world(tmp.file("ckpt"), model, data, 1, 3, 2);
  EXPECT_EQ(checkpoint_steps(tmp.file("ckpt")), (std::vector<int64_t>{1, 3}));
}

TEST_F(CheckpointCorruption, StepThatDisagreesWithTheDirectoryName) {
  const std::string renamed = tmp.file("ckpt") + "/step-7";
  fs::rename(dir, renamed);
  const std::string e = error_of([&] { open_checkpoint(renamed); });
  EXPECT_NE(e.find(renamed), std::string::npos) << e;
  EXPECT_NE(e.find("metadata.json says step 4, its directory name says step 7"), std::string::npos) << e;
}

TEST_F(CheckpointCorruption, VerifyReadsEveryPieceOnceAcrossParts) {
  EXPECT_NO_THROW(verify_checkpoint_pieces(open_checkpoint(dir), 0, 1));
  const TensorPiece piece = first_piece(dir, "output.weight", FlatState::ExpAvgSq);
  std::fstream f(shard(piece.rank), std::ios::in | std::ios::out | std::ios::binary);
  char byte = 0;
  f.seekg(piece.byte_offset);
  f.read(&byte, 1);
  byte ^= 0x01;
  f.seekp(piece.byte_offset);
  f.write(&byte, 1);
  f.close();
  const Checkpoint ck = open_checkpoint(dir);
  int failures = 0;
  for (int part = 0; part < 3; ++part) {
    const std::string e = [&] {
      try {
        verify_checkpoint_pieces(ck, part, 3);
      } catch (const Error& error) {
        return std::string(error.what());
      }
      return std::string();
    }();
    if (e.empty()) continue;
    ++failures;
    EXPECT_NE(e.find(shard(piece.rank)), std::string::npos) << e;
    EXPECT_NE(e.find("tensor 'output.weight' (exp_avg_sq)"), std::string::npos) << e;
  }
  EXPECT_EQ(failures, 1);
}

TEST(CheckpointKeepLatest, ZeroKeepsAll) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  const FlatVectors data(numel_of(model), 8);
  for (int64_t step = 1; step <= 4; ++step) save_as_world(tmp.file("ckpt"), model, data, 1, step, 0);
  EXPECT_EQ(checkpoint_steps(tmp.file("ckpt")).size(), 4u);
}

TEST(CheckpointFolder, UnfinishedSavesAreIgnoredThenRemoved) {
  TempDir tmp;
  const ModelConfig model = tiny_model();
  const FlatVectors data(numel_of(model), 9);
  const std::string folder = tmp.file("ckpt");
  save_as_world(folder, model, data, 1, 3);
  fs::create_directories(folder + "/.tmp-step-9-12345");
  write_text(folder + "/.tmp-step-9-12345/rank-0.bin", "half");
  fs::create_directories(folder + "/step-latest");
  EXPECT_EQ(checkpoint_steps(folder), (std::vector<int64_t>{3}));
  EXPECT_EQ(find_checkpoint(folder, -1), folder + "/step-3");
  save_as_world(folder, model, data, 1, 4);
  EXPECT_FALSE(fs::exists(folder + "/.tmp-step-9-12345"));
  EXPECT_EQ(find_checkpoint(folder, -1), folder + "/step-4");
}

TEST(CheckpointFolder, EmptyOrMissingFolderHasNoCheckpoint) {
  TempDir tmp;
  EXPECT_FALSE(find_checkpoint(tmp.file("nothing-here"), -1).has_value());
  EXPECT_TRUE(checkpoint_steps(tmp.file("nothing-here")).empty());
}

}  // namespace
}  // namespace forge
