// Attention for incremental decoding: a step of `queries` new positions (one per generated
// token, or a whole prompt at once) attends to a KV cache of every earlier position.
//
//   qkv      [B, n, Hq + 2*Hkv, D]  the step's fused projection output, rotary already
//                                   applied at its absolute positions position .. position+n-1
//   k_cache, v_cache [B, capacity, Hkv, D]  keys and values of positions 0 .. capacity-1
//   out      [B, n, Hq, D]
// kv_cache_append writes the step's keys and values into the caches at rows position ..
// position + n - 1; decode_attention_forward then gives query i (absolute position
// p = position + i) softmax(scale q.k_j) v_j over the cached j that attention_forward
// (ops/attention.h) lets position p see in a full sequence: j <= p, and p - j < W with a
// sliding window W (AttentionShape). GQA as there: query head h reads kv head h / (Hq/Hkv).
// Tensors follow NOTE [Op placement]: fp32 on the CPU, bf16 on CUDA.
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
