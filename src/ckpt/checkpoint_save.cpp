// Writing a checkpoint: shard files (streamed: NOTE [Streaming checkpoints] in
// ckpt/checkpoint_stream.h) and metadata into a temporary directory, fsynced, then
// renamed into place, then old checkpoints pruned. See NOTE [Checkpoint format] and
// NOTE [Atomic checkpoints] in ckpt/checkpoint.h.
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <filesystem>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_layout.h"
#include "ckpt/checkpoint_metadata.h"
#include "ckpt/checkpoint_stream.h"
#include "core/durable_directory.h"
#include "core/error.h"
#include "core/log.h"
#include "model/parameters.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "shard files are little-endian fp32");

constexpr const char* kTemporaryPrefix = ".tmp-";
// Checkpoints are flushed to disk: NOTE [Durable files] in core/durable_file.h says why.
constexpr DurableOptions kCheckpointDurability{.sync = true};

// Leftovers of saves or prunes that a crash interrupted.
void remove_temporaries(const std::string& folder) {
  for (const auto& entry : fs::directory_iterator(folder)) {
    if (!entry.path().filename().string().starts_with(kTemporaryPrefix)) continue;
    std::error_code ec;
    fs::remove_all(entry.path(), ec);
    if (ec) log_warn("cannot remove the unfinished checkpoint '{}': {}", entry.path().string(), ec.message());
  }
}

// One record per (state, tensor), its pieces in layout order with their CRC-32s.
std::vector<TensorRecord> tensor_records(const std::vector<ParamSpec>& specs, const CheckpointLayout& layout,
                                         const std::vector<uint32_t>& crcs) {
  FORGE_CHECK(crcs.size() == layout.pieces.size(), "checkpoint: {} CRCs for {} pieces", crcs.size(),
              layout.pieces.size());
  std::vector<TensorRecord> records;
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    const PieceLayout& p = layout.pieces[i];
    const ParamSpec& spec = specs.at(p.spec);
    if (records.empty() || records.back().name != spec.name || records.back().state != p.state)
      records.push_back({spec.name, p.state, spec.shape, p.whole.flat_offset, {}});
    TensorPiece piece{p.rank, p.whole.flat_index(p.whole.begin), p.byte_offset,
                      p.whole.size() * static_cast<int64_t>(sizeof(float)), crcs[i]};
    if (!p.whole.whole_width()) {
      piece.band_begin = p.whole.band_begin;
      piece.band_width = p.whole.band_width;
    }
    records.back().pieces.push_back(piece);
  }
  return records;
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

// Keeps the checkpoint just saved and the newest keep_latest_k - 1 older ones that are
// whole as far as opening tells (metadata, shard files and sizes; the CRCs are checked at
// resume); removes the other older ones. A damaged checkpoint never takes the place of a
// whole one. Newer ones (a damaged checkpoint a resume passed over, or the later steps of a
// run resumed with checkpoint.load_step) are left alone: this run replaces them as it gets
// there.
void keep_latest(const std::string& folder, int64_t saved_step, int64_t keep_latest_k) {
  std::vector<int64_t> older;
  for (int64_t step : checkpoint_steps(folder))
    if (step < saved_step) older.push_back(step);
  std::sort(older.rbegin(), older.rend());
  int64_t kept = 1;  // the one just saved
  for (int64_t step : older) {
    bool whole = kept < keep_latest_k;
    if (whole) {
      try {
        open_checkpoint(checkpoint_dir(folder, step));
      } catch (const Error& e) {
        log_warn("checkpoint.keep_latest_k: not counting '{}', which is damaged: {}", checkpoint_dir(folder, step),
                 e.what());
        whole = false;
      }
    }
    if (whole) ++kept;
    else remove_checkpoint(folder, step);
  }
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

std::string checkpoint_temporary_dir(const std::string& folder, int64_t step, int64_t token) {
  return fmt::format("{}/{}step-{}-{}", folder, kTemporaryPrefix, step, token);
}

AtomicDirectory begin_checkpoint_save(const std::string& folder, int64_t step, int64_t token) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) FORGE_FAIL("cannot create checkpoint folder '{}' (checkpoint.folder): {}", folder, ec.message());
  remove_temporaries(folder);
  return AtomicDirectory(checkpoint_dir(folder, step), checkpoint_temporary_dir(folder, step, token),
                         kCheckpointDurability);
}

std::string finish_checkpoint_save(const std::string& folder, AtomicDirectory& staging, const ModelConfig& model,
                                   const std::string& experiment_yaml, const TrainingState& state,
                                   const std::vector<ShardRange>& ranges,
                                   const std::vector<std::vector<uint32_t>>& crcs_by_rank, int64_t keep_latest_k) {
  return finish_checkpoint_save(folder, staging, model, parameter_specs(model), experiment_yaml, state, ranges,
                                crcs_by_rank, keep_latest_k);
}

std::string finish_checkpoint_save(const std::string& folder, AtomicDirectory& staging, const ModelConfig& model,
                                   const std::vector<ParamSpec>& specs, const std::string& experiment_yaml,
                                   const TrainingState& state, const std::vector<ShardRange>& ranges,
                                   const std::vector<std::vector<uint32_t>>& crcs_by_rank, int64_t keep_latest_k) {
  FORGE_CHECK(!ranges.empty() && crcs_by_rank.size() == ranges.size(), "checkpoint: {} ranges, {} CRC lists",
              ranges.size(), crcs_by_rank.size());
  const CheckpointLayout layout = checkpoint_layout(specs, ranges);
  // Each rank's CRC-32s are its pieces', in layout order.
  std::vector<uint32_t> crcs;
  std::vector<size_t> next(ranges.size(), 0);
  for (const PieceLayout& p : layout.pieces) {
    const auto r = static_cast<size_t>(p.rank);
    FORGE_CHECK(next[r] < crcs_by_rank[r].size(), "checkpoint: rank {} sent {} CRCs, too few", r,
                crcs_by_rank[r].size());
    crcs.push_back(crcs_by_rank[r][next[r]++]);
  }
  for (size_t r = 0; r < ranges.size(); ++r)
    FORGE_CHECK(next[r] == crcs_by_rank[r].size(), "checkpoint: rank {} sent {} CRCs for {} pieces", r,
                crcs_by_rank[r].size(), next[r]);
  return finish_checkpoint_save(folder, staging, model, specs, experiment_yaml, state, layout, crcs, keep_latest_k);
}

namespace {

// Writes `md` (its model or flux config already set) with the tensor records of `layout`,
// renames the directory into place and prunes.
std::string finish_save(const std::string& folder, AtomicDirectory& staging, CheckpointMetadata md,
                        const std::vector<ParamSpec>& specs, const std::string& experiment_yaml,
                        const TrainingState& state, const CheckpointLayout& layout, const std::vector<uint32_t>& crcs,
                        int64_t keep_latest_k) {
  FORGE_CHECK(staging.path() == checkpoint_dir(folder, state.step), "checkpoint of step {} staged for '{}'", state.step,
              staging.path());
  md.format_version = layout.format_version();
  md.experiment_yaml = experiment_yaml;
  md.training = state;
  for (const ParamSpec& spec : specs) md.flat_numel += shape_numel(spec.shape);
  md.tensor_parallel = layout.tensor_parallel;
  if (md.format_version == kCheckpointFormatVersion) md.shards = layout.ranges;
  md.file_numel = layout.file_numel;
  md.tensors = tensor_records(specs, layout, crcs);
  write_file_atomic(staging.temporary_path() + "/" + kCheckpointMetadataFile, metadata_to_json(md),
                    kCheckpointDurability);
  staging.commit();
  if (keep_latest_k > 0) keep_latest(folder, state.step, keep_latest_k);
  return staging.path();
}

}  // namespace

std::string finish_checkpoint_save(const std::string& folder, AtomicDirectory& staging, const ModelConfig& model,
                                   const std::vector<ParamSpec>& specs, const std::string& experiment_yaml,
                                   const TrainingState& state, const CheckpointLayout& layout,
                                   const std::vector<uint32_t>& crcs, int64_t keep_latest_k) {
  CheckpointMetadata md;
  md.model = model;
  return finish_save(folder, staging, std::move(md), specs, experiment_yaml, state, layout, crcs, keep_latest_k);
}

std::string finish_flux_checkpoint_save(const std::string& folder, AtomicDirectory& staging, const FluxConfig& flux,
                                        const std::vector<ParamSpec>& specs, const std::string& experiment_yaml,
                                        const TrainingState& state, const CheckpointLayout& layout,
                                        const std::vector<uint32_t>& crcs, int64_t keep_latest_k) {
  CheckpointMetadata md;
  md.flux = flux;
  return finish_save(folder, staging, std::move(md), specs, experiment_yaml, state, layout, crcs, keep_latest_k);
}

std::string save_checkpoint(const std::string& folder, const ModelConfig& model, const std::string& experiment_yaml,
                            const TrainingState& state, const std::vector<ShardData>& shards, int64_t keep_latest_k,
                            size_t buffer_bytes) {
  FORGE_CHECK(!shards.empty(), "save_checkpoint without shards");
  std::vector<ShardRange> ranges;
  for (const ShardData& shard : shards) ranges.push_back(shard.range);
  AtomicDirectory staging = begin_checkpoint_save(folder, state.step, ::getpid());
  create_checkpoint_shard_files(staging.temporary_path(), ranges);
  ShardFileWriter writer(staging.temporary_path(), model, ranges, buffer_bytes);
  for (const ShardData& shard : shards) {
    const float* vectors[] = {shard.params, shard.exp_avg, shard.exp_avg_sq};
    for (FlatState s : kFlatStates)
      writer.write(s, {shard.range.begin, Tensor::wrap(const_cast<float*>(vectors[static_cast<int>(s)]),
                                                       {shard.range.size()}, DType::F32)});
  }
  return finish_checkpoint_save(folder, staging, model, experiment_yaml, state, ranges,
                                combine_piece_crcs(model, ranges, writer.finish()), keep_latest_k);
}

}  // namespace forge
