// Grouped-query attention, causal unless asked otherwise, on the packed output of the fused
// QKV projection (NOTE [Bidirectional attention]).
//
// qkv is [B, T, Hq + 2*Hkv, D]: heads [0, Hq) are queries, [Hq, Hq+Hkv) keys, and
// [Hq+Hkv, Hq+2*Hkv) values. Query head h reads key/value head h / (Hq / Hkv), so K and V
// are never copied up to the query heads. Query position i sees key position j when
// j <= i (causal) and, with a sliding window W > 0, i - j < W (Mistral 7B v0.1).
//   out[b,i,h,:] = sum_j softmax_j(scale * q.k_j) v_j      out is [B, T, Hq, D]
//   lse[b,h,i]   = log sum_j exp(scale * q.k_j)           lse is [B, Hq, T], fp32
// The backward recomputes probabilities from lse and overwrites dqkv (same packing).
//
// NOTE [Bidirectional attention]
// With AttentionShape::causal false there is no causal mask: query i sees every key j of
// its row (of its example, with segments). FLUX's joint attention over text and image
// tokens is this. The backward is the same formula; cuDNN is asked for no mask.
//
// NOTE [Value head dim]
// Values may have a head dim of their own, Dv, different from the queries' and keys' D
// (DeepSeek's multi-head latent attention: D = 192, 128 of them content and 64 rotary,
// Dv = 128). A value head is then not a head of the 4-D tensor above, so qkv is 3-D,
// [B, T, (Hq + Hkv) D + Hkv Dv]: per token the Hq query heads (D each), then the Hkv key
// heads (D each), then the Hkv value heads (Dv each), one after another. out (and dout) are
// [B, T, Hq, Dv]; lse is unchanged; dqkv has qkv's layout. The shape says which form it
// expects (AttentionShape::distinct_v_head_dim): the 3-D one when v_head_dim is set and
// differs from head_dim, which must then be set too; else the 4-D one, whose last dim must
// equal head_dim where that is set. Everything else (GQA, the window, packed examples) is
// the same in both forms; the uniform form is the 3-D one's layout with Dv = D.
//
// NOTE [Packed examples]
// A packed sample holds several examples one after another (instruction data, see
// data/sft_dataset.h). Attention is then confined to each example: query i sees key j only
// when both are in the same example (and j <= i, and within the sliding window), and the
// rotary positions restart at 0 with each example (ops/rope.h), so every example computes
// exactly what it would alone. An example is a run of equal segment ids in a row of the
// batch (padding after the last example is a run of its own, computed and ignored).
// AttentionSegments holds that layout in the form the tensors' device reads, built once per
// micro-batch and used by every layer: on the CPU the first token of each token's example;
// on CUDA cuDNN's ragged ("THD") description — every example of the micro-batch is one
// sequence of cuDNN's batch, given by its length and the element offset of its first token
// in qkv, out and lse, with cuDNN's padding mask — and the softmax statistics are kept
// token-major, lse [B * T, Hq] (the same number of floats), as ragged statistics are.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

struct AttentionShape {
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t sliding_window = 0;  // 0: unlimited
  float scale = 0.0f;          // usually 1/sqrt(head_dim)
  // NOTE [Value head dim]. head_dim: of queries and keys, 0 to read it off a 4-D qkv;
  // v_head_dim: of values, 0 for head_dim.
  int64_t head_dim = 0;
  int64_t v_head_dim = 0;
  // NOTE [Bidirectional attention]: false lets every query see every key of its sequence
  // (or of its example when packed), as a diffusion transformer's joint attention does;
  // a sliding window needs causal attention. Last, so that the positional initializers
  // {heads, kv heads, window, scale, head dims} keep their meaning.
  bool causal = true;

  // Whether qkv takes the 3-D form, with values of their own head dim.
  bool distinct_v_head_dim() const { return v_head_dim > 0 && v_head_dim != head_dim; }
  // The qkv and out shapes of a [batch, seq] micro-batch in the form this shape expects
  // (head_dim must be set).
  Shape qkv_shape(int64_t batch, int64_t seq) const;
  Shape out_shape(int64_t batch, int64_t seq) const;
};

// The examples of a micro-batch (NOTE [Packed examples]), for one device.
struct AttentionSegments {
  Device device = Device::CPU;
  int64_t batch = 0, seq = 0;
  int64_t qkv_width = 0, out_width = 0;  // elements per token of the qkv and out it was built for
  Tensor example_start;  // CPU: int32 [B, T], the index in its row of each token's example's first token
  // CUDA: `capacity` sequences for cuDNN (the examples, then empty ones: a power of two, so
  // that few graphs are built), device int32 lengths [capacity] and int64 element offsets
  // [capacity + 1] of each sequence's first token in qkv, out and lse.
  int64_t num_examples = 0, capacity = 0;
  Tensor lengths, qkv_offsets, out_offsets, lse_offsets;
};

// segment_ids: int32 [B, T] on the CPU; each run of equal ids in a row is one example.
// shape must set head_dim (and v_head_dim for the 3-D form): CUDA's offsets count elements.
AttentionSegments attention_segments(const Tensor& segment_ids, const AttentionShape& shape, Device device);

// Throws naming `op` unless `shape` is valid (heads that split into groups, window >= 0,
// scale > 0, head dims >= 0) and qkv has the form it expects (NOTE [Value head dim]).
// Shared by the training and decode attention ops.
void check_attention_shape(const Tensor& qkv, const AttentionShape& shape, const char* op);

// segments: the micro-batch's packed examples (null: each row is one sequence).
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& shape,
                       const AttentionSegments* segments = nullptr);
void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, const AttentionShape& shape, const AttentionSegments* segments = nullptr);

}  // namespace forge
