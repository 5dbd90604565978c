// Writing a checkpoint: shard files and metadata into a temporary directory, fsynced, then
// renamed into place, then old checkpoints pruned. See NOTE [Checkpoint format] and
// NOTE [Atomic checkpoints] in ckpt/checkpoint.h.
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <filesystem>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_crc32.h"
#include "ckpt/checkpoint_files.h"
#include "ckpt/checkpoint_metadata.h"
#include "core/error.h"
#include "core/log.h"
#include "model/parameters.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "shard files are little-endian fp32");

constexpr const char* kTemporaryPrefix = ".tmp-";

const float* shard_vector(const ShardData& shard, FlatState state) {
  switch (state) {
    case FlatState::Param: return shard.params;
    case FlatState::ExpAvg: return shard.exp_avg;
    case FlatState::ExpAvgSq: return shard.exp_avg_sq;
  }
  return nullptr;
}

// Leftovers of saves or prunes that a crash interrupted.
void remove_temporaries(const std::string& folder) {
  for (const auto& entry : fs::directory_iterator(folder)) {
    if (!entry.path().filename().string().starts_with(kTemporaryPrefix)) continue;
    std::error_code ec;
    fs::remove_all(entry.path(), ec);
    if (ec) log_warn("cannot remove the unfinished checkpoint '{}': {}", entry.path().string(), ec.message());
  }
}

// One record per (state, parameter), one piece per shard the parameter overlaps.
std::vector<TensorRecord> tensor_records(const std::vector<ParamSpec>& specs, const std::vector<ShardData>& shards) {
  std::vector<TensorRecord> records;
  for (FlatState state : kFlatStates) {
    int64_t offset = 0;
    for (const ParamSpec& spec : specs) {
      TensorRecord rec{spec.name, state, spec.shape, offset, {}};
      const int64_t end = offset + shape_numel(spec.shape);
      for (size_t r = 0; r < shards.size(); ++r) {
        const ShardRange& range = shards[r].range;
        const int64_t b = std::max(offset, range.begin), e = std::min(end, range.end);
        if (b >= e) continue;
        const float* data = shard_vector(shards[r], state) + (b - range.begin);
        const int64_t bytes = (e - b) * static_cast<int64_t>(sizeof(float));
        const int64_t byte_offset =
            (static_cast<int64_t>(state) * range.size() + (b - range.begin)) * static_cast<int64_t>(sizeof(float));
        rec.pieces.push_back({static_cast<int>(r), b, byte_offset, bytes, crc32(data, static_cast<size_t>(bytes))});
      }
      records.push_back(std::move(rec));
      offset = end;
    }
  }
  return records;
}

void write_shard(const std::string& path, const ShardData& shard) {
  DurableFile file(path);
  for (FlatState state : kFlatStates)
    file.write(shard_vector(shard, state), static_cast<size_t>(shard.range.size()) * sizeof(float));
  file.close();
}

// Moves a checkpoint out of sight (one rename), then deletes it.
void remove_checkpoint(const std::string& folder, int64_t step) {
  const std::string doomed = fmt::format("{}/{}delete-step-{}-{}", folder, kTemporaryPrefix, step, ::getpid());
  std::error_code ec;
  fs::rename(checkpoint_dir(folder, step), doomed, ec);
  if (ec) FORGE_FAIL("cannot remove old checkpoint '{}': {}", checkpoint_dir(folder, step), ec.message());
  fsync_directory(folder);
  fs::remove_all(doomed, ec);
  if (ec) log_warn("cannot delete '{}': {}", doomed, ec.message());
}

void keep_latest(const std::string& folder, int64_t saved_step, int64_t keep_latest_k) {
  std::vector<int64_t> others;
  for (int64_t step : checkpoint_steps(folder))
    if (step != saved_step) others.push_back(step);
  std::sort(others.rbegin(), others.rend());
  for (size_t i = static_cast<size_t>(keep_latest_k - 1); i < others.size(); ++i) remove_checkpoint(folder, others[i]);
}

}  // namespace

std::vector<ShardRange> shard_ranges(int64_t numel, int world) {
  FORGE_CHECK(world >= 1 && numel >= 0, "numel {} world {}", numel, world);
  std::vector<ShardRange> ranges;
  int64_t begin = 0;
  for (int r = 0; r < world; ++r) {
    int64_t size = numel / world + (r < numel % world ? 1 : 0);
    ranges.push_back({begin, begin + size});
    begin += size;
  }
  return ranges;
}

std::string save_checkpoint(const std::string& folder, const ModelConfig& model, const std::string& experiment_yaml,
                            const TrainingState& state, const std::vector<ShardData>& shards, int64_t keep_latest_k) {
  const std::vector<ParamSpec> specs = parameter_specs(model);
  int64_t numel = 0;
  for (const ParamSpec& spec : specs) numel += shape_numel(spec.shape);
  FORGE_CHECK(!shards.empty(), "save_checkpoint without shards");
  int64_t covered = 0;
  for (const ShardData& shard : shards) {
    FORGE_CHECK(shard.range.begin == covered && shard.range.end >= shard.range.begin, "shards must tile [0, {})",
                numel);
    covered = shard.range.end;
  }
  FORGE_CHECK(covered == numel, "shards cover {} of {} parameters", covered, numel);

  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) FORGE_FAIL("cannot create checkpoint folder '{}' (checkpoint.folder): {}", folder, ec.message());
  remove_temporaries(folder);

  const std::string tmp = fmt::format("{}/{}step-{}-{}", folder, kTemporaryPrefix, state.step, ::getpid());
  fs::create_directory(tmp, ec);
  if (ec) FORGE_FAIL("cannot create '{}': {}", tmp, ec.message());

  CheckpointMetadata md;
  md.model = model;
  md.experiment_yaml = experiment_yaml;
  md.training = state;
  md.flat_numel = numel;
  for (const ShardData& shard : shards) md.shards.push_back(shard.range);
  md.tensors = tensor_records(specs, shards);

  for (size_t r = 0; r < shards.size(); ++r) write_shard(fmt::format("{}/rank-{}.bin", tmp, r), shards[r]);
  write_file_durable(tmp + "/" + kCheckpointMetadataFile, metadata_to_json(md));
  fsync_directory(tmp);

  const std::string dir = checkpoint_dir(folder, state.step);
  const bool replaced = rename_replacing_directory(tmp, dir);
  fsync_directory(folder);
  if (replaced) fs::remove_all(tmp, ec);  // the checkpoint step-<N> held before
  if (keep_latest_k > 0) keep_latest(folder, state.step, keep_latest_k);
  return dir;
}

}  // namespace forge
