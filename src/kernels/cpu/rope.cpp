// Rotary position embeddings, Hugging Face Llama's "rotate half" convention, in place.
//
// For a head vector x of size D at position t, with half = D / 2 and i < half,
//   x'[i]        = x[i] * cos(t f_i) - x[i + half] * sin(t f_i)
//   x'[i + half] = x[i + half] * cos(t f_i) + x[i] * sin(t f_i)
// using precomputed cos/sin tables [positions, half]; t is the token's index in its row, or
// its given position (packed examples, each starting at 0). A rotation's transpose is its
// inverse, so the backward is the same loop with the sign of sin flipped. Each (batch,
// position) row of heads is independent; threads split them.
#include "kernels/cpu/rope.h"

#include <algorithm>

#include "core/parallel.h"

namespace forge::cpu {

void rope_rotate(float* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t rotated_heads,
                 const float* cos, const float* sin, const int32_t* positions, bool inverse) {
  int64_t half = head_dim / 2;
  float sin_sign = inverse ? -1.0f : 1.0f;
  int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(rotated_heads * head_dim, 1));
  parallel_for(batch * seq, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      int64_t t = positions ? positions[row] : row % seq;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        float* lo = x + (row * heads + h) * head_dim;
        float* hi = lo + half;
        for (int64_t i = 0; i < half; ++i) {
          float a = lo[i], b = hi[i], si = sin_sign * s[i];
          lo[i] = a * c[i] - b * si;
          hi[i] = b * c[i] + a * si;
        }
      }
    }
  });
}

}  // namespace forge::cpu
