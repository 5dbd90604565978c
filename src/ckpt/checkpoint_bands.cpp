#include "ckpt/checkpoint_bands.h"

#include "core/error.h"

namespace forge {
namespace {

// The runs of a shard (tensor_parallel_runs, in local order) as band ranges of the whole
// parameter (flat offset `whole`, rows of `columns`): one band when the runs are equal
// parts of consecutive rows (a row-parallel projection's columns), else one whole-width
// range per stretch of runs consecutive in both places.
std::vector<ShardStretch> stretches_of(const std::vector<ShardRun>& runs, int64_t local, int64_t whole,
                                       int64_t columns) {
  std::vector<ShardStretch> out;
  if (runs.empty()) return out;
  const ShardRun& first = runs.front();
  const int64_t width = first.count, band_begin = first.full_begin % columns, row = first.full_begin / columns;
  bool band = runs.size() > 1 && width < columns && band_begin + width <= columns;
  for (size_t i = 0; band && i < runs.size(); ++i) {
    const auto k = static_cast<int64_t>(i);
    band = runs[i].count == width && runs[i].local_begin == first.local_begin + k * width &&
           runs[i].full_begin == first.full_begin + k * columns;
  }
  if (band) {
    const auto rows = static_cast<int64_t>(runs.size());
    out.push_back({local + first.local_begin, {whole, columns, band_begin, width, row * width, (row + rows) * width}});
    return out;
  }
  for (const ShardRun& run : runs) {
    if (run.count == 0) continue;
    if (!out.empty()) {
      ShardStretch& last = out.back();
      if (last.local_begin + last.whole.size() == local + run.local_begin && last.whole.end == run.full_begin) {
        last.whole.end += run.count;
        continue;
      }
    }
    out.push_back({local + run.local_begin, {whole, columns, 0, columns, run.full_begin, run.full_begin + run.count}});
  }
  return out;
}

}  // namespace

ShardPlacement::ShardPlacement(const std::vector<ParamSpec>& specs, TensorParallelShard shard) : shard_(shard) {
  FORGE_CHECK(shard.size >= 1 && shard.rank >= 0 && shard.rank < shard.size, "tensor-parallel rank {} of {}",
              shard.rank, shard.size);
  int64_t whole = 0;
  for (const ParamSpec& full : specs) {
    const int64_t numel = shape_numel(full.shape);
    const int64_t columns = band_columns(full.shape);
    const std::vector<ShardRun> runs =
        shard.size == 1 ? std::vector<ShardRun>{{0, 0, numel}} : tensor_parallel_runs(full, shard);
    int64_t held = 0;
    for (const ShardRun& run : runs) held += run.count;
    local_offsets_.push_back(local_numel_);
    stretches_.push_back(stretches_of(runs, local_numel_, whole, columns));
    replicated_.push_back(shard.size > 1 && full.tensor_parallel == TensorParallelSplit::Replicated);
    local_numel_ += held;
    whole += numel;
  }
  local_offsets_.push_back(local_numel_);
}

size_t ShardPlacement::spec_at(int64_t at) const {
  FORGE_CHECK(at >= 0 && at < local_numel_, "element {} of a rank's {}", at, local_numel_);
  // The last parameter that starts at or before `at` (empty ones start where the next does).
  const auto it = std::upper_bound(local_offsets_.begin(), local_offsets_.end() - 1, at);
  return static_cast<size_t>(it - local_offsets_.begin()) - 1;
}

bool ShardPlacement::replicated(int64_t at) const { return replicated_[spec_at(at)]; }

std::vector<BandRange> ShardPlacement::image(int64_t begin, int64_t count) const {
  FORGE_CHECK(begin >= 0 && count >= 0 && begin + count <= local_numel_, "elements [{}, {}) of a rank's {}", begin,
              begin + count, local_numel_);
  std::vector<BandRange> out;
  if (count == 0) return out;
  const int64_t end = begin + count;
  for (size_t p = spec_at(begin); p < stretches_.size() && local_offsets_[p] < end; ++p)
    for (const ShardStretch& s : stretches_[p]) {
      const int64_t x = std::max(begin, s.local_begin), y = std::min(end, s.local_begin + s.whole.size());
      if (x >= y) continue;
      BandRange r = s.whole;
      r.begin = s.whole.begin + (x - s.local_begin);
      r.end = r.begin + (y - x);
      out.push_back(r);
    }
  return out;
}

}  // namespace forge
