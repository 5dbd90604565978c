// Streaming checkpoints (ckpt/checkpoint_stream.h): the files are byte for byte those the
// in-memory writer forge had before (kept here as the oracle), however the segments are
// cut, ordered, typed or spread over writers, and whatever the buffer; saving and loading
// a state many times the buffer's size adds about the buffer to the process's peak
// resident memory, not the state.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_crc32.h"
#include "ckpt/checkpoint_stream.h"
#include "core/bf16.h"
#include "core/durable_file.h"
#include "core/rng.h"
#include "model/parameters.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

ModelConfig model_of(int64_t hidden, int64_t layers, int64_t ffn, int64_t vocab) {
  ModelConfig m;
  m.name = "stream-test";
  m.vocab_size = vocab;
  m.hidden_size = hidden;
  m.num_layers = layers;
  m.num_heads = 2;
  m.num_kv_heads = 1;
  m.ffn_hidden_size = ffn;
  return m;
}

int64_t numel_of(const ModelConfig& m) {
  int64_t n = 0;
  for (const ParamSpec& s : parameter_specs(m)) n += shape_numel(s.shape);
  return n;
}

// Three flat vectors; with `bf16_moments`, m and v hold bf16-representable values (so a
// bf16 copy of them widens back to the same fp32).
struct State {
  std::vector<float> vec[3];
  State(int64_t numel, uint64_t seed, bool bf16_moments) {
    Rng rng(seed);
    for (int s = 0; s < 3; ++s)
      for (int64_t i = 0; i < numel; ++i) {
        const float x = static_cast<float>(rng.normal());
        vec[s].push_back(bf16_moments && s > 0 ? to_float(to_bf16(x)) : x);
      }
  }
};

TrainingState state_at(int64_t step) {
  TrainingState s;
  s.step = step;
  s.data_position = step * 4;
  s.seed = 7;
  s.lr_schedule_steps = 50;
  s.optimizer_step = step;
  return s;
}

const char* kYaml = "model:\n  name: stream-test\n";

// The writer forge had before saves streamed: each rank's file the concatenation of its
// three ranges, each piece's CRC-32 computed over the piece in memory.
std::string oracle_save(const std::string& folder, const ModelConfig& model, const State& st, int world, int64_t step) {
  const std::vector<ShardRange> ranges = shard_ranges(numel_of(model), world);
  AtomicDirectory staging = begin_checkpoint_save(folder, step, ::getpid());
  std::vector<std::vector<uint32_t>> crcs(ranges.size());
  for (size_t r = 0; r < ranges.size(); ++r) {
    AtomicFile file(fmt::format("{}/rank-{}.bin", staging.temporary_path(), r), {.sync = false});
    for (int s = 0; s < 3; ++s)
      file.write(st.vec[s].data() + ranges[r].begin, static_cast<size_t>(ranges[r].size()) * sizeof(float));
    file.commit();
  }
  for (int s = 0; s < 3; ++s) {
    int64_t offset = 0;
    for (const ParamSpec& spec : parameter_specs(model)) {
      const int64_t end = offset + shape_numel(spec.shape);
      for (size_t r = 0; r < ranges.size(); ++r) {
        const int64_t b = std::max(offset, ranges[r].begin), e = std::min(end, ranges[r].end);
        if (b < e) crcs[r].push_back(crc32(st.vec[s].data() + b, static_cast<size_t>(e - b) * sizeof(float)));
      }
      offset = end;
    }
  }
  return finish_checkpoint_save(folder, staging, model, kYaml, state_at(step), ranges, crcs, 0);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void expect_same_files(const std::string& want_dir, const std::string& got_dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(want_dir)) names.push_back(e.path().filename().string());
  size_t got_count = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(got_dir)) ++got_count;
  EXPECT_EQ(names.size(), got_count) << got_dir;
  for (const std::string& name : names) {
    ASSERT_TRUE(fs::exists(got_dir + "/" + name)) << name;
    EXPECT_TRUE(file_bytes(want_dir + "/" + name) == file_bytes(got_dir + "/" + name)) << name << " differs";
  }
}

// Writes `st` as `writers` processes would under FSDP: the flat space of each vector cut
// into segments of random lengths, dealt to the writers, each writing its own in a
// shuffled order; moments as bf16 tensors when asked.
std::string streamed_save(const std::string& folder, const ModelConfig& model, const State& st, int world,
                          int writers, size_t buffer_bytes, bool bf16_moments, uint64_t seed, int64_t step) {
  const std::vector<ShardRange> ranges = shard_ranges(numel_of(model), world);
  AtomicDirectory staging = begin_checkpoint_save(folder, step, ::getpid());
  create_checkpoint_shard_files(staging.temporary_path(), ranges);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<std::pair<FlatState, FlatSegment>>> work(static_cast<size_t>(writers));
  std::vector<std::vector<BFloat16>> narrow_copies;
  narrow_copies.reserve(4096);
  for (FlatState s : kFlatStates) {
    const std::vector<float>& v = st.vec[static_cast<int>(s)];
    const int64_t n = static_cast<int64_t>(v.size());
    for (int64_t at = 0; at < n;) {
      const int64_t len = std::min<int64_t>(n - at, 1 + static_cast<int64_t>(rng() % 97));
      Tensor data;
      if (bf16_moments && s != FlatState::Param) {
        narrow_copies.emplace_back();
        for (int64_t i = at; i < at + len; ++i) narrow_copies.back().push_back(to_bf16(v[static_cast<size_t>(i)]));
        data = Tensor::wrap(narrow_copies.back().data(), {len}, DType::BF16);
      } else {
        data = Tensor::wrap(const_cast<float*>(v.data() + at), {len}, DType::F32);
      }
      work[rng() % static_cast<size_t>(writers)].push_back({s, {at, data}});
      at += len;
    }
  }
  std::vector<PieceCrc> parts;
  for (auto& mine : work) {
    std::shuffle(mine.begin(), mine.end(), rng);
    ShardFileWriter writer(staging.temporary_path(), model, ranges, buffer_bytes);
    for (const auto& [state, segment] : mine) writer.write(state, segment);
    for (const PieceCrc& p : writer.finish()) parts.push_back(p);
  }
  // Through the words the ranks exchange, as the trainer does.
  const std::vector<uint32_t> words = encode_piece_crcs(parts);
  parts = decode_piece_crcs(words.data(), words.size() / kPieceCrcWords);
  return finish_checkpoint_save(folder, staging, model, kYaml, state_at(step), ranges,
                                combine_piece_crcs(model, ranges, parts), 0);
}

TEST(CheckpointStream, SavesTheOracleBytesHoweverTheSegmentsCome) {
  const ModelConfig model = model_of(8, 2, 16, 16);
  TempDir tmp;
  const std::string root = tmp.file("root");
  int case_index = 0;
  for (int world : {1, 2, 3}) {
    for (bool bf16 : {false, true}) {
      const State st(numel_of(model), 11 + static_cast<uint64_t>(world), bf16);
      const std::string want = oracle_save(root + "/oracle-" + std::to_string(case_index), model, st, world, 5);
      for (int writers : {1, 3}) {
        for (size_t buffer : {size_t{8}, size_t{100}, size_t{1} << 20}) {
          const std::string folder = fmt::format("{}/streamed-{}", root, case_index++);
          const std::string got = streamed_save(folder, model, st, world, writers, buffer, bf16, 99 + buffer, 5);
          SCOPED_TRACE(fmt::format("world {} bf16 {} writers {} buffer {}", world, bf16, writers, buffer));
          expect_same_files(want, got);
        }
      }
    }
  }
  // save_checkpoint (from host vectors) streams too.
  const State st(numel_of(model), 3, false);
  const std::string want = oracle_save(root + "/oracle-host", model, st, 2, 9);
  std::vector<ShardData> shards;
  for (const ShardRange& r : shard_ranges(numel_of(model), 2))
    shards.push_back({r, st.vec[0].data() + r.begin, st.vec[1].data() + r.begin, st.vec[2].data() + r.begin});
  expect_same_files(want, save_checkpoint(root + "/host", model, kYaml, state_at(9), shards, 0, 64));
}

TEST(CheckpointStream, ReadsIntoSegmentsOfEitherDtypeThroughASmallBuffer) {
  const ModelConfig model = model_of(8, 2, 16, 16);
  const State st(numel_of(model), 21, true);
  TempDir tmp;
  const std::string dir = oracle_save(tmp.file("ckpt"), model, st, 3, 4);
  const Checkpoint ck = open_checkpoint(dir);
  ShardFileReader reader(ck, 24);  // three floats per half
  const int64_t n = numel_of(model);
  for (FlatState s : kFlatStates) {
    const std::vector<float>& want = st.vec[static_cast<int>(s)];
    for (int64_t at = 0; at < n; at += 37) {
      const int64_t len = std::min<int64_t>(37, n - at);
      std::vector<float> wide(static_cast<size_t>(len));
      reader.read(s, {at, Tensor::wrap(wide.data(), {len}, DType::F32)});
      EXPECT_TRUE(std::equal(wide.begin(), wide.end(), want.begin() + at)) << flat_state_name(s) << " at " << at;
      std::vector<BFloat16> narrow(static_cast<size_t>(len));
      reader.read(s, {at, Tensor::wrap(narrow.data(), {len}, DType::BF16)});
      for (int64_t i = 0; i < len; ++i)
        ASSERT_EQ(narrow[static_cast<size_t>(i)].bits, to_bf16(want[static_cast<size_t>(at + i)]).bits);
    }
  }
}

TEST(CheckpointStream, CombinedCrcsMustCoverEveryPieceOnce) {
  const ModelConfig model = model_of(8, 2, 16, 16);
  const std::vector<ShardRange> ranges = shard_ranges(numel_of(model), 2);
  const std::vector<PieceLayout> pieces = checkpoint_pieces(model, ranges);
  std::vector<PieceCrc> parts;
  for (size_t i = 0; i < pieces.size(); ++i)
    parts.push_back({static_cast<int64_t>(i), 0, (pieces[i].flat_end - pieces[i].flat_begin) * 4, 0});
  EXPECT_NO_THROW(combine_piece_crcs(model, ranges, parts));
  std::vector<PieceCrc> missing(parts.begin() + 1, parts.end());
  EXPECT_THROW(combine_piece_crcs(model, ranges, missing), Error);
  std::vector<PieceCrc> twice = parts;
  twice.push_back(parts[3]);
  EXPECT_THROW(combine_piece_crcs(model, ranges, twice), Error);
}

TEST(CheckpointStream, AWriterThreadErrorSurfacesNamingTheFile) {
  const ModelConfig model = model_of(8, 2, 16, 16);
  const int64_t numel = numel_of(model);
  TempDir tmp;
  fs::create_directories(tmp.file("save"));  // no shard files were made: the writer thread cannot open them
  std::vector<float> data(static_cast<size_t>(numel), 1.0f);
  std::string message;
  try {
    ShardFileWriter writer(tmp.file("save"), model, shard_ranges(numel, 2), 64);
    writer.write(FlatState::Param, {0, Tensor::wrap(data.data(), {numel}, DType::F32)});
    writer.finish();
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("rank-0.bin"), std::string::npos) << message;
}

// NOTE [Streaming checkpoints]: the host memory a save or a load adds is its buffer. The
// process's peak resident memory (VmHWM) is reset to its resident size (clear_refs) before
// each, and what it rose by is compared with the buffer and the shard.
int64_t status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::atoll(line.c_str() + std::strlen(field));
  return -1;
}

bool reset_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

TEST(CheckpointStream, HostMemoryStaysNearTheBufferNotTheShard) {
  if (!reset_peak()) GTEST_SKIP() << "/proc/self/clear_refs cannot be written here";
  const ModelConfig model = model_of(256, 8, 1024, 8192);  // 10.5 M parameters: a 126 MB shard
  const int64_t numel = numel_of(model);
  const double shard_mib = 12.0 * static_cast<double>(numel) / 1048576.0;
  ASSERT_GT(shard_mib, 100.0);
  const size_t buffer = size_t{1} << 20;
  const State st(numel, 5, false);
  TempDir tmp;
  const std::string folder = tmp.file("ckpt");

  ASSERT_TRUE(reset_peak());
  const int64_t before_save = status_kib("VmRSS:");
  const std::vector<ShardData> shards = {
      {shard_ranges(numel, 1).front(), st.vec[0].data(), st.vec[1].data(), st.vec[2].data()}};
  const std::string dir = save_checkpoint(folder, model, kYaml, state_at(1), shards, 0, buffer);
  const double save_growth_mib = static_cast<double>(status_kib("VmHWM:") - before_save) / 1024.0;

  State loaded(0, 0, false);
  for (auto& v : loaded.vec) v.assign(static_cast<size_t>(numel), 1.0f);  // resident before measuring
  const Checkpoint ck = open_checkpoint(dir);
  ASSERT_TRUE(reset_peak());
  const int64_t before_load = status_kib("VmRSS:");
  {
    ShardFileReader reader(ck, buffer);
    for (FlatState s : kFlatStates)
      reader.read(s, {0, Tensor::wrap(loaded.vec[static_cast<int>(s)].data(), {numel}, DType::F32)});
  }
  const double load_growth_mib = static_cast<double>(status_kib("VmHWM:") - before_load) / 1024.0;
  for (int s = 0; s < 3; ++s) EXPECT_TRUE(loaded.vec[s] == st.vec[s]);

  RecordProperty("shard_mib", std::to_string(shard_mib));
  RecordProperty("save_growth_mib", std::to_string(save_growth_mib));
  RecordProperty("load_growth_mib", std::to_string(load_growth_mib));
  std::printf("shard %.1f MiB, buffer 1 MiB: peak resident memory +%.2f MiB saving, +%.2f MiB loading\n", shard_mib,
              save_growth_mib, load_growth_mib);
  // The measurement sees memory that is staged: one vector of the shard, copied, shows.
  ASSERT_TRUE(reset_peak());
  const int64_t before_copy = status_kib("VmRSS:");
  const std::vector<float> staged = st.vec[0];
  const double copy_growth_mib = static_cast<double>(status_kib("VmHWM:") - before_copy) / 1024.0;
  EXPECT_GT(copy_growth_mib, shard_mib / 3 - 1) << staged.size();
  // The buffer, the writer thread's stack and the metadata: a few MiB, not the 126 MB shard.
  EXPECT_LT(save_growth_mib, 8.0);
  EXPECT_LT(load_growth_mib, 8.0);
}

}  // namespace
}  // namespace forge
