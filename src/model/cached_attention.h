// The attention of a decoder block run over a KV cache, for incremental
// decoding (NOTE [Incremental decoding] in incremental_decoder.h).
//
// A training attention component (self_attention.h, latent_attention.h)
// computes whole sequences; a cached attention computes a step's new positions
// against every earlier position, whose keys and values it keeps (one cache per
// layer, one sequence), with the same parameters in the same order
// (ComponentWeights) and the same arithmetic, so a step's output is the
// training forward's at those positions:
//   - CachedSelfAttention (the Llama family's GQA / MHA / sliding window):
//   rmsnorm → qkv
//     → rotary at the step's absolute positions → keys and values appended to
//     the cache → decode attention (ops/decode_attention.h) → o + residual;
//   - CachedLatentAttention (DeepSeek's Multi-head Latent Attention, NOTE
//   [Multi-head
//     Latent Attention]): the same projections, norms and packing as
//     LatentAttention, the packed rows' keys and values (every head's, expanded
//     from the compressed kv) appended to the cache, decode attention with
//     values of their own head dim → o + residual. The cache holds the expanded
//     keys and values, H (dn + dr + dv) numbers per position, not the
//     compressed c_kv and k_pe (kv_rank + dr) that DeepSeek's own inference
//     keeps by absorbing kv_b into the query and output projections: about 9x
//     the memory for DeepSeek-V2-Lite, simple and exact, enough for a
//     sanity-check generator.
#pragma once

#include <cstdint>
#include <memory>

#include "core/tensor.h"
#include "model/activations.h"
#include "model/block_component.h"
#include "model/config.h"
#include "model/parameters.h"

namespace forge {

class CachedAttention {
public:
  virtual ~CachedAttention() = default;
  // Places the buffers of a step of `tokens` positions (ArenaLayout: once to
  // count, once more to make the views).
  virtual void lay_out(ArenaLayout &layout, int64_t tokens) = 0;
  // y = x + attention(x) ([n, hidden], n the laid-out tokens) for block
  // `layer`, the step's positions starting at `position`; appends their keys
  // and values to the layer's cache.
  virtual void forward(int layer, const ComponentWeights &w, const Tensor &x,
                       const Tensor &y, int64_t position) = 0;
};

// The cached form of a block's attention component, with caches of `capacity`
// positions for config.num_layers layers, activations in `dtype` on `device`;
// null when `component` is not an attention (it works on each position alone,
// or is refused by the caller).
std::unique_ptr<CachedAttention>
make_cached_attention(const BlockComponent &component,
                      const ModelConfig &config, int64_t capacity,
                      Device device, DType dtype);

} // namespace forge
