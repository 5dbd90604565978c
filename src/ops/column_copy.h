// A block of columns copied between two 2-D tensors: the concatenations and splits a
// model does along a non-leading axis, without a kernel of its own for each. Viewing
// [B, T, F] as [B, T*F] makes a sequence range [t0, t0 + n) the columns [t0 F, (t0 + n) F);
// viewing [N, F] as is makes a feature range its columns.
//   dst[r, dst_col + c] = src[r, src_col + c]      r < rows (both), c < width
// dst and src have the same dtype, device and row count; the column ranges must lie within
// each. CUDA: a strided 2-D copy on the current stream.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

void copy_columns(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width);

}  // namespace forge
