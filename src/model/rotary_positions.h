// What every attention component with rotary embeddings prepares the same way: the
// cos/sin tables for the step's sequence length, and per micro-batch the positions and
// attention segments of its packed examples (NOTE [Packed examples]). SelfAttention rotates
// its whole head dim, LatentAttention its decoupled rotary part; both hold one of these.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "model/block_component.h"
#include "model/config.h"
#include "ops/attention.h"

namespace forge {

class RotaryPositions {
 public:
  // rotary_dim: the rotated width per head; theta and scaling: the model's RoPE.
  RotaryPositions(int64_t rotary_dim, double theta, const RopeScaling& scaling)
      : rotary_dim_(rotary_dim), theta_(theta), scaling_(scaling) {}

  // The tables for seq_len positions (with YaRN's attention factor), on `device`.
  void prepare(int64_t seq_len, Device device);
  // The micro-batch's packed examples (null: none), their segments for `attention`.
  void set_layout(const SequenceLayout* layout, const AttentionShape& attention);

  const Tensor& cos() const { return cos_; }
  const Tensor& sin() const { return sin_; }
  // Per-token positions and the attention's segments of a packed micro-batch; null otherwise.
  const Tensor* positions() const { return packed_ ? &positions_ : nullptr; }
  const AttentionSegments* segments() const { return packed_ ? &segments_ : nullptr; }

 private:
  int64_t rotary_dim_;
  double theta_;
  RopeScaling scaling_;
  Tensor cos_, sin_;
  Device device_ = Device::CPU;
  bool packed_ = false;
  Tensor positions_;  // int32 [B, T] on the device
  AttentionSegments segments_;
};

}  // namespace forge
