// The decoder language model run one step at a time over a KV cache, for generation.
//
// NOTE [Incremental decoding]
// Generation feeds a prompt once (prefill) and then one token per step. DecoderLM would
// recompute every earlier position at every step; IncrementalDecoder keeps each layer's
// keys and values ([1, capacity, kv_heads, head_dim] in the compute dtype, one sequence)
// and computes only the step's new positions. It runs the same blocks with the same
// weights (ParamSource, NOTE [Block weights]) in the same order, so a step's logits are
// the full forward's logits at those positions (tests/cpu/test_model_incremental.cpp):
//   - the block's components come from make_block_components (NOTE [Composed blocks]).
//     Those that work on each position alone (the SwiGLU feed-forward) are run as they
//     are, through their own forward, on the step's tokens. Self-attention, the one that
//     mixes positions, is run here instead with its own parameters: rmsnorm → qkv →
//     rotary at the step's absolute positions (the tables narrowed to them) → the keys and
//     values appended to the cache → decode attention over the cache (ops/decode_attention.h:
//     the causal mask, GQA and sliding window of the training attention) → o + residual.
//     A component kind this class does not know is refused, not guessed at.
//   - the cache keeps every position up to capacity (no ring buffer for sliding windows:
//     the window only limits which cached keys a query reads).
//   - a step's buffers (residual stream, attention scratch, the feed-forward's arena laid
//     out for its tokens under full checkpointing, which shares one set across layers) are
//     laid out for the step's token count and kept while steps keep that count: the
//     prefill lays out once for the prompt, then every decode step reuses the one-token set.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/block_components.h"
#include "model/config.h"
#include "model/parameters.h"
#include "ops/attention.h"

namespace forge {

class IncrementalDecoder {
 public:
  // A cache of `capacity` positions (at most config.max_seq_len is not required: the
  // caller decides how far beyond the trained length it generates). Activations in
  // compute_dtype on `device` (NOTE [Op placement]).
  IncrementalDecoder(const ModelConfig& config, int64_t capacity, Device device = Device::CPU,
                     DType compute_dtype = DType::F32);

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  DType compute_dtype() const { return dtype_; }
  int64_t capacity() const { return capacity_; }
  // Positions cached so far: the next step's tokens sit at position() onwards.
  int64_t position() const { return position_; }
  // Forgets the cached positions (the next step starts a new sequence).
  void reset() { position_ = 0; }

  // Runs `tokens` (int32 [n], n >= 1, on the model's device) at positions position() ..
  // position() + n - 1, caches their keys and values and advances position(). `logits`
  // ([rows, vocab], rows <= n, compute dtype, on the device) receives the logits of the
  // step's last `rows` positions; rows 0 computes none (a prefill whose logits are unused).
  void forward(const Tensor& tokens, ParamSource& weights, const Tensor& logits);

 private:
  void lay_out_step(int64_t tokens);
  // Self-attention of block `layer` over the cache (NOTE above): y = x + o(attention(...)).
  void cached_attention(int layer, const ComponentWeights& w, const Tensor& x, const Tensor& y);

  ModelConfig config_;
  int64_t capacity_, position_ = 0;
  Device device_;
  DType dtype_;
  BlockComponents components_;
  std::vector<bool> is_attention_;   // per component: run by cached_attention
  std::vector<size_t> first_param_;  // per component: its first entry in BlockWeights; then the block's count
  int64_t hidden_, heads_, kv_heads_, head_dim_;
  float eps_;
  AttentionShape attention_;
  Tensor rope_cos_, rope_sin_;               // [capacity, head_dim / 2], fp32, on the device
  std::vector<Tensor> k_cache_, v_cache_;    // per layer [1, capacity, kv_heads, head_dim]
  // The step's buffers, laid out for step_tokens_ tokens.
  int64_t step_tokens_ = 0;
  Tensor arena_;
  Tensor stream_[2];                      // [n, hidden], the residual stream, ping-pong
  Tensor normed_, rstd_, qkv_, attention_out_;
  Tensor final_normed_, final_rstd_;
};

}  // namespace forge
