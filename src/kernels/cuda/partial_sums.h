#pragma once

#include <cstdint>

namespace forge::cuda {

// The second half of a deterministic column reduction: a first kernel writes one partial
// row per block (`parts` rows, `stride` floats apart), this adds them in a fixed order.
//   out[c] = sum_p partial[p * stride + c]   (or out[c] += that, with `accumulate`), c < columns
// Enqueued on the legacy default stream, after the kernel that wrote the partial rows.
void sum_partial_rows(float* out, const float* partial, int64_t parts, int64_t columns, int64_t stride,
                      bool accumulate);

}  // namespace forge::cuda
