// Checkpoints under tensor parallelism (NOTE [Tensor-parallel checkpoints] in
// ckpt/checkpoint_layout.h): the band arithmetic of NOTE [Column bands] against brute
// force; a rank's placement puts each of its shards' values where the whole model has them;
// the layouts tile their files and the whole model once; a state saved by T tensor-parallel
// ranks times S shard ranks comes back exactly through any other layout (the whole model,
// T' ranks, per-parameter segments, bf16, a buffer of a few floats); and damaged band
// pieces are refused naming the file and the tensor.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_bands.h"
#include "ckpt/checkpoint_layout.h"
#include "ckpt/checkpoint_stream.h"
#include "core/bf16.h"
#include "core/rng.h"
#include "model/parameters.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

// Splits over 1, 2 and 4 ranks: 4 heads of 4 (query and key/value), feed-forward 24,
// vocabulary 16.
ModelConfig tp_model(bool tied) {
  ModelConfig m;
  m.name = "tp-ckpt-test";
  m.vocab_size = 16;
  m.hidden_size = 16;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 4;
  m.ffn_hidden_size = 24;
  m.tie_word_embeddings = tied;
  return m;
}

int64_t numel_of(const ModelConfig& m) {
  int64_t n = 0;
  for (const ParamSpec& s : parameter_specs(m)) n += shape_numel(s.shape);
  return n;
}

// The whole model's three flat vectors, distinct values.
struct WholeState {
  std::vector<float> vec[3];
  WholeState(int64_t numel, uint64_t seed) {
    Rng rng(seed);
    for (auto& v : vec)
      for (int64_t i = 0; i < numel; ++i) v.push_back(static_cast<float>(rng.normal()));
  }
  // Rank `placement`'s values of vector s: its shards, in its own order.
  std::vector<float> local(const ShardPlacement& placement, int s) const {
    std::vector<float> out;
    for (const BandRange& r : placement.image(0, placement.numel()))
      for (int64_t k = r.begin; k < r.end; ++k) out.push_back(vec[s][static_cast<size_t>(r.flat_index(k))]);
    return out;
  }
};

TrainingState state_at(int64_t step) {
  TrainingState s;
  s.step = step;
  s.data_position = step * 4;
  s.lr_schedule_steps = 20;
  s.optimizer_step = step;
  return s;
}

// Per-parameter pieces of a rank's index space, each cut at random places: the segments
// FSDP or the one-rank trainer hand a writer (never across a parameter).
std::vector<std::pair<int64_t, int64_t>> random_segments(const ShardPlacement& placement, size_t specs,
                                                         std::mt19937_64& rng) {
  std::vector<std::pair<int64_t, int64_t>> out;  // (begin, count)
  for (size_t p = 0; p < specs; ++p) {
    const int64_t begin = placement.local_offset(p), end = placement.local_offset(p + 1);
    for (int64_t at = begin; at < end;) {
      const int64_t n = std::min<int64_t>(end - at, 1 + static_cast<int64_t>(rng() % 41));
      out.push_back({at, n});
      at += n;
    }
  }
  return out;
}

// Saves `st` as `degree` tensor-parallel ranks with `shards` shard ranks each would: every
// rank writes its shards' values in random segments dealt to its shard ranks, replicated
// parameters on rank 0 only, each writer through its own small buffer.
std::string save_tensor_parallel(const std::string& folder, const ModelConfig& model, const WholeState& st, int degree,
                                 int shards, int64_t step, uint64_t seed) {
  const CheckpointLayout layout = tensor_parallel_checkpoint_layout(model, degree, shards);
  AtomicDirectory staging = begin_checkpoint_save(folder, step, ::getpid());
  create_checkpoint_shard_files(staging.temporary_path(), layout.file_numel);
  std::mt19937_64 rng(seed);
  const size_t specs = parameter_specs(model).size();
  std::vector<PieceCrc> parts;
  for (int t = 0; t < degree; ++t) {
    const ShardPlacement placement(parameter_specs(model), {t, degree});
    std::vector<float> values[3];
    for (int s = 0; s < 3; ++s) values[s] = st.local(placement, s);
    std::vector<std::vector<std::pair<int, std::pair<int64_t, int64_t>>>> work(static_cast<size_t>(shards));
    for (int s = 0; s < 3; ++s)
      for (const auto& segment : random_segments(placement, specs, rng))
        if (t == 0 || !placement.replicated(segment.first)) work[rng() % work.size()].push_back({s, segment});
    for (auto& mine : work) {
      std::shuffle(mine.begin(), mine.end(), rng);
      ShardFileWriter writer(staging.temporary_path(), layout, t, 40);
      for (const auto& [s, segment] : mine)
        writer.write(static_cast<FlatState>(s),
                     {segment.first, Tensor::wrap(values[s].data() + segment.first, {segment.second}, DType::F32)});
      for (const PieceCrc& p : writer.finish()) parts.push_back(p);
    }
  }
  return finish_checkpoint_save(folder, staging, model, parameter_specs(model), "model:\n  name: tp-ckpt-test\n",
                                state_at(step), layout, combine_piece_crcs(layout.pieces, parts), 0);
}

// Reads every vector back as `degree` ranks would, per-parameter segments through `buffer`
// bytes, and compares with st; bf16 destinations for the moments when asked.
void expect_reads_as(const Checkpoint& ck, const ModelConfig& model, const WholeState& st, int degree, size_t buffer,
                     bool bf16_moments) {
  std::mt19937_64 rng(static_cast<uint64_t>(degree) * 31 + buffer);
  const size_t specs = parameter_specs(model).size();
  for (int r = 0; r < degree; ++r) {
    const ShardPlacement placement(parameter_specs(model), {r, degree});
    ShardFileReader reader(ck, buffer);
    for (int s = 0; s < 3; ++s) {
      const std::vector<float> want = st.local(placement, s);
      const bool narrow = bf16_moments && s > 0;
      std::vector<float> wide(want.size());
      std::vector<BFloat16> bf16(want.size());
      for (const auto& [begin, count] : random_segments(placement, specs, rng)) {
        const Tensor out = narrow ? Tensor::wrap(bf16.data() + begin, {count}, DType::BF16)
                                  : Tensor::wrap(wide.data() + begin, {count}, DType::F32);
        reader.read(static_cast<FlatState>(s), out, placement.image(begin, count));
      }
      for (size_t i = 0; i < want.size(); ++i) {
        if (narrow) ASSERT_EQ(bf16[i].bits, to_bf16(want[i]).bits) << "rank " << r << " of " << degree << " at " << i;
        else ASSERT_EQ(wide[i], want[i]) << flat_state_name(static_cast<FlatState>(s)) << " rank " << r << " of "
                                         << degree << " at " << i;
      }
    }
  }
}

TEST(CheckpointBands, CommonRunsAreTheSharedElementsInOrder) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t columns = 1 + static_cast<int64_t>(rng() % 9), rows = 1 + static_cast<int64_t>(rng() % 6);
    auto random_range = [&] {
      const int64_t width = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(columns));
      const int64_t first = static_cast<int64_t>(rng() % static_cast<uint64_t>(columns - width + 1));
      const int64_t n = rows * width, begin = static_cast<int64_t>(rng() % static_cast<uint64_t>(n + 1));
      const int64_t end = begin + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - begin + 1));
      return BandRange{100, columns, first, width, begin, end};
    };
    const BandRange a = random_range(), b = random_range();
    std::map<int64_t, int64_t> in_b;  // flat index -> place in b
    for (int64_t k = b.begin; k < b.end; ++k) in_b[b.flat_index(k)] = k - b.begin;
    std::vector<std::pair<int64_t, int64_t>> want, got;
    for (int64_t k = a.begin; k < a.end; ++k)
      if (auto it = in_b.find(a.flat_index(k)); it != in_b.end()) want.push_back({k - a.begin, it->second});
    for_each_common_run(a, b, [&](int64_t at_a, int64_t at_b, int64_t n) {
      for (int64_t i = 0; i < n; ++i) got.push_back({at_a + i, at_b + i});
      return true;
    });
    ASSERT_EQ(got, want) << "trial " << trial;
    ASSERT_EQ(bands_intersect(a, b), !want.empty()) << "trial " << trial;
  }
}

TEST(CheckpointBands, EachShardValueIsWhereTheWholeModelHasIt) {
  for (bool tied : {false, true})
    for (int degree : {2, 4}) {
      SCOPED_TRACE(fmt::format("tied {} degree {}", tied, degree));
      const ModelConfig model = tp_model(tied);
      FlatParameters whole(model);
      whole.initialize(7);
      const float* w = whole.flat().data<float>();
      std::vector<int> held(static_cast<size_t>(whole.flat().numel()), 0);
      for (int r = 0; r < degree; ++r) {
        FlatParameters shard(model, Device::CPU, DType::F32, {r, degree});
        shard.initialize(7);
        const ShardPlacement placement(parameter_specs(model), {r, degree});
        ASSERT_EQ(placement.numel(), shard.flat().numel());
        const float* local = shard.flat().data<float>();
        int64_t at = 0;
        for (const BandRange& range : placement.image(0, placement.numel()))
          for (int64_t k = range.begin; k < range.end; ++k, ++at) {
            ASSERT_EQ(local[at], w[range.flat_index(k)]) << "rank " << r << " element " << at;
            if (r == 0 || !placement.replicated(at)) ++held[static_cast<size_t>(range.flat_index(k))];
          }
        EXPECT_EQ(at, placement.numel());
        // The image of a part is that part of the image.
        for (int64_t begin = 0; begin < placement.numel(); begin += 13) {
          const int64_t count = std::min<int64_t>(29, placement.numel() - begin);
          int64_t i = 0;
          for (const BandRange& range : placement.image(begin, count))
            for (int64_t k = range.begin; k < range.end; ++k, ++i) ASSERT_EQ(local[begin + i], w[range.flat_index(k)]);
          ASSERT_EQ(i, count);
        }
      }
      EXPECT_TRUE(std::all_of(held.begin(), held.end(), [](int n) { return n == 1; }))
          << "every element of the whole model is one rank's to write";
    }
}

TEST(CheckpointLayoutTest, TensorParallelFilesTileTheirBytesAndTheModelOnce) {
  const ModelConfig model = tp_model(false);
  const std::vector<ParamSpec> specs = parameter_specs(model);
  const int64_t numel = numel_of(model);
  for (int degree : {1, 2, 4})
    for (int shards : {1, 2, 3}) {
      SCOPED_TRACE(fmt::format("degree {} shards {}", degree, shards));
      const CheckpointLayout layout = tensor_parallel_checkpoint_layout(model, degree, shards);
      EXPECT_EQ(layout.files(), degree * shards);
      EXPECT_EQ(layout.format_version(), degree > 1 ? 2 : 1);
      int64_t file_total = 0;
      for (int64_t n : layout.file_numel) file_total += n;
      EXPECT_EQ(file_total, numel) << "every element is stored once";
      std::vector<std::vector<int>> held(3, std::vector<int>(static_cast<size_t>(numel), 0));
      std::vector<std::vector<std::pair<int64_t, int64_t>>> bytes(static_cast<size_t>(layout.files()));
      for (const PieceLayout& p : layout.pieces) {
        ASSERT_EQ(p.flat_end - p.flat_begin, p.whole.size());
        for (int64_t k = p.whole.begin; k < p.whole.end; ++k)
          ++held[static_cast<size_t>(p.state)][static_cast<size_t>(p.whole.flat_index(k))];
        bytes[static_cast<size_t>(p.rank)].push_back({p.byte_offset, p.whole.size() * 4});
        // Its writers' elements [flat_begin, flat_end) are exactly its band range.
        const ShardPlacement placement(specs, {p.rank % degree, degree});
        const std::vector<BandRange> image = placement.image(p.flat_begin, p.flat_end - p.flat_begin);
        ASSERT_EQ(image.size(), 1u);
        EXPECT_EQ(image[0].flat_index(image[0].begin), p.whole.flat_index(p.whole.begin));
        EXPECT_EQ(image[0].band_width, p.whole.band_width);
      }
      for (const auto& of_state : held)
        EXPECT_TRUE(std::all_of(of_state.begin(), of_state.end(), [](int n) { return n == 1; }));
      for (size_t f = 0; f < bytes.size(); ++f) {
        std::sort(bytes[f].begin(), bytes[f].end());
        int64_t next = 0;
        for (const auto& [offset, length] : bytes[f]) {
          EXPECT_EQ(offset, next) << "file " << f;
          next = offset + length;
        }
        EXPECT_EQ(next, 12 * layout.file_numel[f]) << "file " << f;
      }
      if (degree == 1) {
        const std::vector<PieceLayout> format1 = checkpoint_pieces(specs, shard_ranges(numel, shards));
        ASSERT_EQ(format1.size(), layout.pieces.size());
        for (size_t i = 0; i < format1.size(); ++i) {
          EXPECT_EQ(format1[i].rank, layout.pieces[i].rank);
          EXPECT_EQ(format1[i].flat_begin, layout.pieces[i].flat_begin);
          EXPECT_EQ(format1[i].byte_offset, layout.pieces[i].byte_offset);
        }
      }
    }
}

TEST(CheckpointTensorParallel, ASaveUnderAnyLayoutLoadsUnderAnyOther) {
  TempDir tmp;
  for (bool tied : {false, true}) {
    const ModelConfig model = tp_model(tied);
    const WholeState st(numel_of(model), tied ? 3 : 4);
    for (const auto& [degree, shards] : {std::pair{2, 1}, {2, 3}, {4, 2}}) {
      SCOPED_TRACE(fmt::format("tied {}, saved by {} x {}", tied, degree, shards));
      const std::string dir = save_tensor_parallel(tmp.file(fmt::format("{}-{}-{}", tied, degree, shards)), model, st,
                                                   degree, shards, 5, 17 + static_cast<uint64_t>(degree));
      const Checkpoint ck = open_checkpoint(dir);
      check_checkpoint_model(ck, model, /*same_architecture=*/true);
      EXPECT_EQ(ck.metadata.format_version, 2);
      EXPECT_EQ(ck.metadata.tensor_parallel, degree);
      EXPECT_EQ(ck.metadata.files(), degree * shards);
      int64_t bytes = 0;
      for (int r = 0; r < ck.metadata.files(); ++r)
        bytes += static_cast<int64_t>(fs::file_size(fmt::format("{}/rank-{}.bin", dir, r)));
      EXPECT_EQ(bytes, 12 * numel_of(model)) << "replicated parameters are written once";
      verify_checkpoint_pieces(ck, 0, 1);
      std::vector<float> whole(static_cast<size_t>(numel_of(model)));
      for (int s = 0; s < 3; ++s) {
        read_flat_range(ck, static_cast<FlatState>(s), 0, whole);
        EXPECT_EQ(whole, st.vec[s]);
      }
      for (int reader_degree : {1, 2, 4})
        for (size_t buffer : {size_t{24}, size_t{1} << 20})
          for (bool bf16_moments : {false, true}) {
            SCOPED_TRACE(fmt::format("read by {} ranks through {} bytes, bf16 moments {}", reader_degree, buffer,
                                     bf16_moments));
            expect_reads_as(ck, model, st, reader_degree, buffer, bf16_moments);
          }
    }
  }
}

class TensorParallelCheckpointDamage : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = save_tensor_parallel(tmp_.file("ckpt"), model_, WholeState(numel_of(model_), 9), 2, 2, 3, 1);
  }
  std::string metadata() const { return dir_ + "/metadata.json"; }
  nlohmann::json read_metadata() const {
    std::ifstream in(metadata());
    return nlohmann::json::parse(in);
  }
  void write_metadata(const nlohmann::json& j) const { std::ofstream(metadata()) << j.dump(); }
  // The first band piece's record and piece index in the metadata.
  std::pair<size_t, size_t> first_band_piece(const nlohmann::json& j) const {
    for (size_t t = 0; t < j["tensors"].size(); ++t)
      for (size_t p = 0; p < j["tensors"][t]["pieces"].size(); ++p)
        if (j["tensors"][t]["pieces"][p].contains("band_width")) return {t, p};
    ADD_FAILURE() << "no band piece";
    return {0, 0};
  }
  std::string error_loading() const {
    try {
      const Checkpoint ck = open_checkpoint(dir_);
      check_checkpoint_model(ck, model_, true);
      std::vector<float> out(static_cast<size_t>(ck.metadata.flat_numel));
      for (FlatState s : kFlatStates) read_flat_range(ck, s, 0, out);
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "the damaged checkpoint loaded";
    return "";
  }

  TempDir tmp_;
  ModelConfig model_ = tp_model(false);
  std::string dir_;
};

TEST_F(TensorParallelCheckpointDamage, ABandMovedToOtherColumns) {
  nlohmann::json j = read_metadata();
  const auto [t, p] = first_band_piece(j);
  j["tensors"][t]["pieces"][p]["band_begin"] = j["tensors"][t]["pieces"][p]["band_begin"].get<int64_t>() + 1;
  write_metadata(j);
  const std::string e = error_loading();
  EXPECT_NE(e.find(metadata()), std::string::npos) << e;
  EXPECT_NE(e.find(j["tensors"][t]["name"].get<std::string>()), std::string::npos) << e;
}

TEST_F(TensorParallelCheckpointDamage, AMissingPiece) {
  nlohmann::json j = read_metadata();
  const auto [t, p] = first_band_piece(j);
  j["tensors"][t]["pieces"].erase(p);
  write_metadata(j);
  const std::string e = error_loading();
  EXPECT_NE(e.find(j["tensors"][t]["name"].get<std::string>()), std::string::npos) << e;
}

TEST_F(TensorParallelCheckpointDamage, PiecesThatOverlapInTheirFile) {
  nlohmann::json j = read_metadata();
  const auto [t, p] = first_band_piece(j);
  j["tensors"][t]["pieces"][p]["byte_offset"] = j["tensors"][t]["pieces"][p]["byte_offset"].get<int64_t>() + 4;
  write_metadata(j);
  const std::string e = error_loading();
  EXPECT_NE(e.find("rank-"), std::string::npos) << e;
}

TEST_F(TensorParallelCheckpointDamage, AFileOfAnotherSize) {
  nlohmann::json j = read_metadata();
  j["shards"][1]["numel"] = j["shards"][1]["numel"].get<int64_t>() + 1;
  write_metadata(j);
  EXPECT_NE(error_loading().find("rank-1.bin"), std::string::npos);
}

TEST_F(TensorParallelCheckpointDamage, AFlippedByteFailsItsPiecesCrc) {
  const std::string shard = dir_ + "/rank-3.bin";
  std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(40);
  f.put('\x7f');
  f.close();
  const std::string e = error_loading();
  EXPECT_NE(e.find("rank-3.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("CRC-32"), std::string::npos) << e;
}

TEST_F(TensorParallelCheckpointDamage, AMissingKeyIsNamed) {
  nlohmann::json j = read_metadata();
  j.erase("tensor_parallel_degree");
  write_metadata(j);
  EXPECT_NE(error_loading().find("tensor_parallel_degree"), std::string::npos);
}

}  // namespace
}  // namespace forge
