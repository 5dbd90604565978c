// The decoder language model run one step at a time over a KV cache, for generation.
//
// NOTE [Incremental decoding]
// Generation feeds a prompt once (prefill) and then one token per step. DecoderLM would
// recompute every earlier position at every step; IncrementalDecoder keeps each layer's
// keys and values (one sequence, in the compute dtype) and computes only the step's new
// positions. It runs the same blocks with the same weights (ParamSource, NOTE [Block
// weights]) in the same order, so a step's logits are the full forward's logits at those
// positions (tests/cpu/test_model_incremental.cpp):
//   - the block's components come from make_block_components (NOTE [Composed blocks]).
//     Those that work on each position alone (BlockComponent::position_wise: the SwiGLU
//     and dropless MoE feed-forwards, and DeepSeek's dense first blocks before its MoE
//     ones) are run as they are, through their own forward, on the step's tokens. The
//     attention, the one that mixes positions, runs in its cached form (cached_attention.h:
//     Llama's GQA / MHA / sliding window, DeepSeek's Multi-head Latent Attention) with its
//     own parameters. A component kind with neither is refused, not guessed at.
//   - a model trained with token dropping (model.moe_capacity_factor, NOTE [MoE capacity]
//     in ops/moe.h) is decoded dropless: a capacity is a share of a micro-batch's tokens,
//     which a decode step of one token does not have, and the Hugging Face export of such a
//     model (transformers' Mixtral and DeepSeek routing) is dropless too.
//   - the cache keeps every position up to capacity (no ring buffer for sliding windows:
//     the window only limits which cached keys a query reads).
//   - a step's buffers (residual stream, attention scratch, the feed-forward's arena laid
//     out for its tokens under full checkpointing, which shares one set across layers) are
//     laid out for the step's token count and kept while steps keep that count: the
//     prefill lays out once for the prompt, then every decode step reuses the one-token set.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "model/block_components.h"
#include "model/cached_attention.h"
#include "model/config.h"
#include "model/parameters.h"

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

  ModelConfig config_;
  int64_t capacity_, position_ = 0;
  Device device_;
  DType dtype_;
  BlockComponents components_;
  // Per component: its cached form when it is the attention (null for a position-wise one).
  std::vector<std::unique_ptr<CachedAttention>> cached_;
  // Per layer: each component's first entry in the block's weights, then the block's count
  // (DeepSeek's dense first blocks have fewer than its MoE blocks).
  std::vector<std::vector<size_t>> first_param_;
  int64_t hidden_;
  float eps_;
  // The step's buffers, laid out for step_tokens_ tokens.
  int64_t step_tokens_ = 0;
  Tensor arena_;
  Tensor stream_[2];  // [n, hidden], the residual stream, ping-pong
  Tensor final_normed_, final_rstd_;
};

}  // namespace forge
