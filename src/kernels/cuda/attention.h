#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// Packed examples as cuDNN's ragged sequences (NOTE [Packed examples] in ops/attention.h):
// `capacity` sequences (those past the examples have length 0), device arrays.
struct RaggedSequences {
  int64_t capacity = 0;                // 0: every row of the batch is one sequence
  const int32_t* lengths = nullptr;    // [capacity] tokens
  const int64_t* qkv_offsets = nullptr;  // [capacity + 1] element offset of the first token in qkv
  const int64_t* out_offsets = nullptr;  // ... in out (and dout)
  const int64_t* lse_offsets = nullptr;  // ... in lse
};

// Chunk attention (NOTE [Chunk attention] in ops/attention_chunk.h): the seq queries are
// positions [position, position + seq) of sequences whose keys and values are in kv bf16
// [B, kv_seq, 2 Hkv, D] (per token the key heads, then the value heads; Dv = D).
// With packed examples (NOTE [Chunk attention with packed examples]) `ragged` describes the
// queries' sequences and these the keys': per sequence its key count and the element offset
// of its first key in kv (device arrays, [ragged.capacity] and [ragged.capacity + 1]).
struct KeyValueChunk {
  int64_t position = 0;
  int64_t kv_seq = 0;  // 0: no chunk, keys and values in qkv
  const int32_t* kv_lengths = nullptr;
  const int64_t* kv_offsets = nullptr;
  // Set inside attention_chunk_forward/backward for a full chunk with a window (NOTE [Full
  // chunk attention with a sliding window] in ops/attention_chunk.h), 0 otherwise: cuDNN's
  // band with the diagonal at the top left (query i keeps key j when j > i - band_left), over
  // `keys` rows of kv, the queries' tensors holding q_rows rows per batch (> seq when trimmed).
  int64_t band_left = 0;
  int64_t keys = 0;
  int64_t q_rows = 0;
};

struct AttentionProblem {
  int64_t batch, seq, q_heads, kv_heads;
  int64_t head_dim;    // of queries and keys
  int64_t v_head_dim;  // of values, out and dout
  int64_t sliding_window;  // 0: none
  float scale;
  RaggedSequences ragged{};
  KeyValueChunk chunk{};  // the chunk forms below only
  // false: no mask but the ragged padding (NOTE [Bidirectional attention]); for a chunk,
  // every key of kv (NOTE [Full chunk attention])
  bool causal = true;
};

// qkv bf16 [B, T, (Hq + Hkv) D + Hkv Dv] (packed as the fused projection writes it: per
// token the query heads, the key heads, the value heads; [B, T, Hq + 2 Hkv, D] when Dv = D);
// out bf16 [B, T, Hq, Dv]; lse fp32 [B, Hq, T], or [B * T, Hq] with ragged sequences.
void attention_forward(bf16* out, float* lse, const bf16* qkv, const AttentionProblem& p);
// Overwrites dqkv (same packing as qkv) from dout bf16 [B, T, Hq, Dv].
void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                        const AttentionProblem& p);

// Chunk attention (p.chunk.kv_seq > 0; ragged sequences only with the chunk's key lengths and
// offsets; not causal with a window: position >= kv_seq, the band of NOTE [Full chunk
// attention with a sliding window], refused when it leaves a single query): the queries in
// the chunk's qkv [B, T, Hq + 2 Hkv, D] (its query heads), keys and values in kv; out and lse
// as above.
void attention_chunk_forward(bf16* out, float* lse, const bf16* qkv, const bf16* kv, const AttentionProblem& p);
// Overwrites dqkv's query heads (not its key/value heads) and all of dkv [B, kv_seq, 2 Hkv,
// D], zero past the chunk's last position.
void attention_chunk_backward(bf16* dqkv, bf16* dkv, const bf16* dout, const bf16* qkv, const bf16* kv,
                              const bf16* out, const float* lse, const AttentionProblem& p);

}  // namespace forge::cuda
