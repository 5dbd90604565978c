#include "ckpt/checkpoint_layout.h"

#include "core/error.h"

namespace forge {
namespace {

constexpr int64_t kFloatBytes = sizeof(float);

// The layout of `degree` tensor-parallel ranks of `specs` (the whole model's) whose index
// spaces are each split into `ranges` (file d T + t: range d of rank t's), every piece
// the part of a file's range inside one stretch of a rank's shard, replicated parameters
// in rank 0's files only.
CheckpointLayout make_layout(const std::vector<ParamSpec>& specs, int degree, const std::vector<ShardRange>& ranges) {
  FORGE_CHECK(degree >= 1 && !ranges.empty(), "checkpoint layout of {} tensor-parallel ranks, {} ranges", degree,
              ranges.size());
  std::vector<ShardPlacement> places;
  for (int t = 0; t < degree; ++t) places.emplace_back(specs, TensorParallelShard{t, degree});
  int64_t covered = 0;
  for (const ShardRange& range : ranges) {
    FORGE_CHECK(range.begin == covered && range.end >= range.begin, "checkpoint shards must tile [0, {})",
                places[0].numel());
    covered = range.end;
  }
  FORGE_CHECK(covered == places[0].numel(), "checkpoint shards cover {} of {} elements", covered, places[0].numel());
  CheckpointLayout layout;
  layout.tensor_parallel = degree;
  const size_t files = ranges.size() * static_cast<size_t>(degree);
  layout.ranges.resize(files);
  layout.file_numel.assign(files, 0);
  // Visits the part of every file inside every stretch of every tensor's shard, by tensor,
  // then by file: visit(file, spec, local [x, y), its band range).
  auto for_each_part = [&](auto&& visit) {
    for (size_t spec = 0; spec < specs.size(); ++spec)
      for (size_t f = 0; f < files; ++f) {
        const int t = static_cast<int>(f % static_cast<size_t>(degree));
        if (t > 0 && specs[spec].tensor_parallel == TensorParallelSplit::Replicated) continue;
        const ShardRange& range = ranges[f / static_cast<size_t>(degree)];
        for (const ShardStretch& s : places[static_cast<size_t>(t)].stretches(spec)) {
          const int64_t x = std::max(range.begin, s.local_begin);
          const int64_t y = std::min(range.end, s.local_begin + s.whole.size());
          if (x >= y) continue;
          BandRange whole = s.whole;
          whole.begin = s.whole.begin + (x - s.local_begin);
          whole.end = whole.begin + (y - x);
          visit(f, spec, x, y, whole);
        }
      }
  };
  for (size_t f = 0; f < files; ++f) layout.ranges[f] = ranges[f / static_cast<size_t>(degree)];
  for_each_part([&](size_t f, size_t, int64_t x, int64_t y, const BandRange&) { layout.file_numel[f] += y - x; });
  for (FlatState state : kFlatStates) {
    std::vector<int64_t> filled(files, 0);  // elements of the file's `state` third placed so far
    for_each_part([&](size_t f, size_t spec, int64_t x, int64_t y, const BandRange& whole) {
      const int64_t byte_offset = (static_cast<int64_t>(state) * layout.file_numel[f] + filled[f]) * kFloatBytes;
      layout.pieces.push_back({state, static_cast<int>(f), x, y, byte_offset, spec, whole});
      filled[f] += y - x;
    });
  }
  return layout;
}

}  // namespace

int CheckpointLayout::format_version() const {
  return tensor_parallel > 1 ? kTensorParallelCheckpointFormatVersion : kCheckpointFormatVersion;
}

CheckpointLayout checkpoint_layout(const std::vector<ParamSpec>& specs, const std::vector<ShardRange>& ranges) {
  return make_layout(specs, 1, ranges);
}

CheckpointLayout tensor_parallel_checkpoint_layout(const ModelConfig& model, int degree, int shards) {
  const std::vector<ParamSpec> local = parameter_specs(model, TensorParallelShard{0, degree});
  int64_t numel = 0;
  for (const ParamSpec& spec : local) numel += shape_numel(spec.shape);
  return make_layout(parameter_specs(model), degree, shard_ranges(numel, shards));
}

std::vector<PieceLayout> checkpoint_pieces(const ModelConfig& model, const std::vector<ShardRange>& ranges) {
  return checkpoint_pieces(parameter_specs(model), ranges);
}

std::vector<PieceLayout> checkpoint_pieces(const std::vector<ParamSpec>& specs, const std::vector<ShardRange>& ranges) {
  return checkpoint_layout(specs, ranges).pieces;
}

BandRange piece_band(const TensorRecord& record, const TensorPiece& piece) {
  const int64_t columns = band_columns(record.shape);
  const bool band = piece.band_width > 0;
  const int64_t width = band ? piece.band_width : columns, band_begin = band ? piece.band_begin : 0;
  const int64_t local = piece.flat_begin - record.flat_offset;
  const int64_t begin = (local / columns) * width + local % columns - band_begin;
  return {record.flat_offset, columns, band_begin, width, begin, begin + piece.byte_length / kFloatBytes};
}

}  // namespace forge
