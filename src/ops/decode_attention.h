// Attention for incremental decoding: a step of `queries` new positions (one per generated
// token, or a whole prompt at once) attends to a KV cache of every earlier position.
//
// Two forms, as the training attention's (NOTE [Value head dim] in ops/attention.h); the
// shape says which (AttentionShape::distinct_v_head_dim). With one head dim D for queries,
// keys and values:
//   qkv      [B, n, Hq + 2*Hkv, D]  the step's fused projection output, rotary already
//                                   applied at its absolute positions position .. position+n-1
//   k_cache, v_cache [B, capacity, Hkv, D]  keys and values of positions 0 .. capacity-1
//   out      [B, n, Hq, D]
// With values of a head dim of their own, Dv (DeepSeek's multi-head latent attention:
// D = 192, Dv = 128):
//   qkv      [B, n, (Hq + Hkv) D + Hkv Dv]  per token the Hq query heads and Hkv key heads
//                                           (D each), then the Hkv value heads (Dv each)
//   k_cache  [B, capacity, Hkv, D]    v_cache [B, capacity, Hkv, Dv]
//   out      [B, n, Hq, Dv]
// kv_cache_append writes the step's keys and values into the caches at rows position ..
// position + n - 1; decode_attention_forward then gives query i (absolute position
// p = position + i) softmax(scale q.k_j) v_j over the cached j that attention_forward
// (ops/attention.h) lets position p see in a full sequence: j <= p, and p - j < W with a
// sliding window W (AttentionShape). GQA as there: query head h reads kv head h / (Hq/Hkv).
// Tensors follow NOTE [Op placement]: fp32 on the CPU, bf16 on CUDA (where D and Dv are at
// most 256).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/attention.h"

namespace forge {

void kv_cache_append(const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv, int64_t position,
                     const AttentionShape& shape);
void decode_attention_forward(const Tensor& out, const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                              int64_t position, const AttentionShape& shape);

}  // namespace forge
