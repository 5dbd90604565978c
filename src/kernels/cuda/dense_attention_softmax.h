// The kernels of dense attention on the GPU (NOTE [Dense attention on the GPU]
// in dense_attention.cpp): moving (sample, head) pairs between forge's
// token-major layout and the head-major, zero-padded matrices the batched GEMMs
// read, and the softmax of the scores plus a bias. Everything is enqueued on
// the legacy default stream.
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// dst [pairs, dst_rows, dst_cols] from src [B, seq, H, cols]: element (p, row,
// c) is src[b, row0 + row, h, c] for the pair pair0 + p = b H + h, and 0 for
// row >= valid_rows or c >= cols (dst_rows >= valid_rows, dst_cols >= cols).
void gather_heads(bf16* dst, const bf16* src, int64_t pair0, int64_t pairs, int64_t heads, int64_t seq, int64_t row0,
                  int64_t valid_rows, int64_t dst_rows, int64_t cols, int64_t dst_cols);

// out[b, row0 + row, h, c] = src[p, row, c] for the pairs pair0 + p = b H + h,
// p < pairs, row < rows and c < cols; out is [B, seq, H, cols], src rows are
// src_cols wide.
void scatter_heads(bf16* out, const bf16* src, int64_t pair0, int64_t pairs, int64_t heads, int64_t seq, int64_t row0,
                   int64_t rows, int64_t cols, int64_t src_cols);

// probs[r, :] = softmax(scores[r, :kv_len] + bias row) and zeros in [kv_len,
// stride), for the pairs * rows rows r of a chunk (each `stride` elements apart
// in both): row r is query row0 + r % rows of the pair pair0 + r / rows, whose
// head h = pair % heads reads the bias row bias[h, row0 + r % rows, :] of the
// [H, q_len, kv_len] bias (null: none).
void softmax_bias_rows(bf16* probs, const float* scores, const bf16* bias, int64_t pairs, int64_t rows, int64_t pair0,
                       int64_t heads, int64_t q_len, int64_t row0, int64_t kv_len, int64_t stride);

}  // namespace forge::cuda
