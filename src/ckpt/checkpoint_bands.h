// Where a rank's elements lie in the whole model: the column bands of NOTE [Column bands],
// the common elements of two band ranges, and the image of a tensor-parallel rank's flat
// index space in the whole model's (ShardPlacement).
//
// NOTE [Column bands]
// A tensor of the whole model is viewed as rows of `columns` elements (its last dimension;
// every other dimension counts rows). A band is its columns [band_begin, band_begin +
// band_width), read row by row: the band's element k is the tensor's row k / band_width,
// column band_begin + k % band_width. A band range is a run [begin, end) of one band's
// elements. The whole width (band_begin 0, band_width = columns) reads the tensor in flat
// order, so any run of consecutive flat elements of one tensor is a band range too.
// This is the one shape a tensor-parallel shard's elements take in the whole tensor (NOTE
// [Tensor-parallel shards] in model/parameters.h): a row-parallel projection's shard is
// one band (its columns), in the shard's own order; a column-parallel one's is a run of
// whole rows per stacked Hugging Face tensor; a replicated one is the whole. So a piece of
// a checkpoint (NOTE [Checkpoint format] in ckpt/checkpoint.h) and a rank's part of a
// tensor are both band ranges, and moving elements between them is matching band ranges:
// for_each_common_run. Two bands of different widths share elements row by row, one run
// per row; the same band shares one run.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/parameters.h"

namespace forge {

// The row length NOTE [Column bands] views a tensor of `shape` with: its last dimension (1
// for a scalar, or when that dimension is 0 and the tensor empty).
inline int64_t band_columns(const Shape& shape) { return shape.empty() || shape.back() == 0 ? 1 : shape.back(); }

struct BandRange {
  int64_t flat_offset = 0;  // the tensor's first element in the whole model's flat index space
  int64_t columns = 1;      // its row length (its last dimension)
  int64_t band_begin = 0, band_width = 1;
  int64_t begin = 0, end = 0;  // elements of the band, row by row
  int64_t size() const { return end - begin; }
  bool whole_width() const { return band_width == columns; }
  // The whole model's flat index of the band's element k.
  int64_t flat_index(int64_t k) const {
    return flat_offset + (k / band_width) * columns + band_begin + k % band_width;
  }
};

// Calls visit(at_a, at_b, count) for each run of elements that a and b (ranges of the same
// tensor) have in common, in the order of both: elements a.begin + at_a ... of a are b.begin
// + at_b ... of b. It stops early when visit returns false; returns whether it stopped.
template <typename Visit>
bool for_each_common_run(const BandRange& a, const BandRange& b, Visit&& visit) {
  if (a.band_begin == b.band_begin && a.band_width == b.band_width) {
    const int64_t lo = std::max(a.begin, b.begin), hi = std::min(a.end, b.end);
    return lo < hi && !visit(lo - a.begin, lo - b.begin, hi - lo);
  }
  const int64_t x0 = std::max(a.band_begin, b.band_begin);
  const int64_t x1 = std::min(a.band_begin + a.band_width, b.band_begin + b.band_width);
  if (x0 >= x1 || a.begin >= a.end || b.begin >= b.end) return false;
  const int64_t a_first = a.begin / a.band_width, a_last = (a.end - 1) / a.band_width;
  const int64_t b_first = b.begin / b.band_width, b_last = (b.end - 1) / b.band_width;
  // The columns of row `row` a range holds: all of its band but in its first and last rows.
  auto columns_of = [](const BandRange& r, int64_t row, int64_t first, int64_t last) {
    const int64_t from = row == first ? r.begin % r.band_width : 0;
    const int64_t to = row == last ? (r.end - 1) % r.band_width + 1 : r.band_width;
    return std::pair{r.band_begin + from, r.band_begin + to};
  };
  for (int64_t row = std::max(a_first, b_first); row <= std::min(a_last, b_last); ++row) {
    const auto [a0, a1] = columns_of(a, row, a_first, a_last);
    const auto [b0, b1] = columns_of(b, row, b_first, b_last);
    const int64_t c0 = std::max({a0, b0, x0}), c1 = std::min({a1, b1, x1});
    if (c0 < c1 &&
        !visit(row * a.band_width + (c0 - a.band_begin) - a.begin, row * b.band_width + (c0 - b.band_begin) - b.begin,
               c1 - c0))
      return true;
  }
  return false;
}

// Whether a and b (ranges of the same tensor) share an element. (Rows inside both ranges
// hold their whole bands, so the search ends by the second row they share.)
inline bool bands_intersect(const BandRange& a, const BandRange& b) {
  return for_each_common_run(a, b, [](int64_t, int64_t, int64_t) { return false; });
}

// Elements of a rank's flat index space that are consecutive in one tensor of the whole
// model: local elements [local_begin, local_begin + whole.size()) are `whole`'s.
struct ShardStretch {
  int64_t local_begin = 0;
  BandRange whole;
};

// The image of tensor-parallel rank `shard`'s flat index space (its shards of `specs`, one
// after the other: parameter_specs(config, shard) order) in the whole model's (`specs`, the
// whole parameters, one after the other), from tensor_parallel_runs. Without tensor
// parallelism ({0, 1}) the two are the same.
class ShardPlacement {
 public:
  ShardPlacement(const std::vector<ParamSpec>& specs, TensorParallelShard shard);

  TensorParallelShard shard() const { return shard_; }
  int64_t numel() const { return local_numel_; }  // the rank's elements
  // Local elements [begin, begin + count) as band ranges of the whole model, in local order.
  std::vector<BandRange> image(int64_t begin, int64_t count) const;
  // The stretches of parameter `spec` (index into specs), in local order.
  const std::vector<ShardStretch>& stretches(size_t spec) const { return stretches_.at(spec); }
  int64_t local_offset(size_t spec) const { return local_offsets_.at(spec); }
  // Whether local element `at` belongs to a parameter every rank of the group holds whole
  // (a norm weight) while the group has more than one rank.
  bool replicated(int64_t at) const;

 private:
  size_t spec_at(int64_t at) const;

  TensorParallelShard shard_;
  std::vector<int64_t> local_offsets_;  // each parameter's first local element; then the total
  std::vector<std::vector<ShardStretch>> stretches_;
  std::vector<bool> replicated_;
  int64_t local_numel_ = 0;
};

}  // namespace forge
