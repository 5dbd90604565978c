// The CPU's reading of CUDA's ragged ("THD") description of a chunk's attention, for the
// tests of the chunk attention with packed examples (all-gather and ring): what cuDNN
// computes from the lengths and offsets of AttentionChunkSegments.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/tensor.h"
#include "ops/attention.h"
#include "ops/attention_chunk.h"

namespace forge::testing {

// out [B, Lq, Hq, D] and token-major lse [B Lq, Hq] from the ragged description, read as
// cuDNN reads it: per sequence e, query i of its q_len sees key j of its kv_len when
// j <= i + kv_len - q_len (causal, the diagonal at the bottom right) or every key (not
// causal: the padding mask only), and within the sliding window when the shape has one.
// Rows no sequence writes stay NaN.
inline void ragged_reference(Tensor& out, Tensor& lse, const Tensor& qkv, const Tensor& kv,
                             const AttentionChunkSegments& s, const AttentionShape& shape) {
  const int64_t d = shape.head_dim, hq = shape.num_q_heads, hkv = shape.num_kv_heads, kv_width = 2 * hkv * d;
  std::fill_n(out.data<float>(), out.numel(), std::numeric_limits<float>::quiet_NaN());
  std::fill_n(lse.data<float>(), lse.numel(), std::numeric_limits<float>::quiet_NaN());
  for (int64_t e = 0; e < s.capacity; ++e) {
    const int64_t q_len = s.q_lengths.data<int32_t>()[e], kv_len = s.kv_lengths.data<int32_t>()[e];
    const float* q0 = qkv.data<float>() + s.q_offsets.data<int64_t>()[e];
    const float* k0 = kv.data<float>() + s.kv_offsets.data<int64_t>()[e];
    float* o0 = out.data<float>() + s.out_offsets.data<int64_t>()[e];
    float* l0 = lse.data<float>() + s.lse_offsets.data<int64_t>()[e];
    for (int64_t i = 0; i < q_len; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t g = h / (hq / hkv), last = s.causal ? i + kv_len - q_len : kv_len - 1;
        const int64_t first = shape.sliding_window > 0 ? std::max<int64_t>(0, last - shape.sliding_window + 1) : 0;
        std::vector<double> scores;
        double top = -1e300;
        for (int64_t j = first; j <= last; ++j) {
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += double(q0[i * s.qkv_width + h * d + x]) * k0[j * kv_width + g * d + x];
          scores.push_back(shape.scale * dot);
          top = std::max(top, scores.back());
        }
        double sum = 0;
        for (double v : scores) sum += std::exp(v - top);
        for (int64_t x = 0; x < d; ++x) {
          double acc = 0;
          for (int64_t j = first; j <= last; ++j)
            acc += std::exp(scores[static_cast<size_t>(j - first)] - top) / sum * k0[j * kv_width + (hkv + g) * d + x];
          o0[(i * hq + h) * d + x] = static_cast<float>(acc);
        }
        l0[i * hq + h] = static_cast<float>(top + std::log(sum));
      }
  }
}

}  // namespace forge::testing
