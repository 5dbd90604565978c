// Rotary position embeddings in the "rotate half" convention of Hugging Face Llama:
// for each head vector x of size D and position t, pairs (x[i], x[i + D/2]) are rotated
// by angle t * inv_freq[i]. Applied in place to the first `num_rotated_heads` heads of a
// packed [B, T, heads, D] tensor (the q and k heads of the fused QKV projection output).
// The backward is the inverse rotation, applied in place to the gradient.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace forge {

// Llama 3.1's frequency scaling ("rope_type": "llama3" in Hugging Face configs).
struct RopeScaling {
  bool enabled = false;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

// inv_freq[i] = theta^(-2i/D), i < D/2, then Llama 3.1 scaling if enabled.
std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling);

// cos/sin tables [max_positions, D/2] (fp32, CPU) for the given frequencies.
void rope_tables(Tensor& cos, Tensor& sin, const std::vector<double>& inv_freq, int64_t max_positions);

// positions: int32 [B, T] on x's device, each token's position (packed examples restart at
// 0, NOTE [Packed examples] in ops/attention.h); null: position t for token t of every row.
// Positions must index rows of the tables (checked on the CPU; on CUDA the caller's duty).
void rope_forward(const Tensor& x, int64_t num_rotated_heads, const Tensor& cos, const Tensor& sin,
                  const Tensor* positions = nullptr);
void rope_backward(const Tensor& dx, int64_t num_rotated_heads, const Tensor& cos, const Tensor& sin,
                   const Tensor* positions = nullptr);

}  // namespace forge
