#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// NOTE [Attention merge] in ops/attention_merge.h: out fp32 [b, l, h, d] and lse fp32 [b, h,
// l] (token_major: [b l, h]) merged in place with part_out bf16 [b, l, h, d] and part_lse as
// lse; enqueued on the legacy default stream.
void attention_merge(float* out, float* lse, const bf16* part_out, const float* part_lse, int64_t b, int64_t l,
                     int64_t h, int64_t d, bool token_major = false);
// lse fp32 [rows, l]: positions [from, l) of every row set to -inf, the lse of queries that
// see no key (NOTE [Full chunk attention with a sliding window] in ops/attention_chunk.h);
// legacy default stream.
void attention_lse_none(float* lse, int64_t rows, int64_t l, int64_t from);

}  // namespace forge::cuda
