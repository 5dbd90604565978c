#include "model/rotary_positions.h"

#include "ops/rope.h"

namespace forge {

void RotaryPositions::prepare(int64_t seq_len, Device device) {
  rope_tables(cos_, sin_, rope_inv_freq(rotary_dim_, theta_, scaling_), seq_len, rope_attention_factor(scaling_));
  cos_ = cos_.to(device);
  sin_ = sin_.to(device);
  device_ = device;
}

void RotaryPositions::set_layout(const SequenceLayout* layout, const AttentionShape& attention) {
  packed_ = layout != nullptr;
  if (!packed_) return;
  positions_ = layout->positions.to(device_);
  segments_ = attention_segments(layout->segments, attention, device_);
}

}  // namespace forge
