#include "kernels/cpu/lora.h"

#include "core/parallel.h"
#include "kernels/lora_dropout_mask.h"

namespace forge::cpu {

void lora_dropout(float* out, const float* in, int64_t n, float p, uint64_t seed, bool accumulate) {
  const uint32_t threshold = lora_dropout_threshold(p);
  const float keep_scale = 1.0f / (1.0f - p);
  parallel_for(n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = lora_keep(seed, i, threshold) ? in[i] * keep_scale : 0.0f;
      out[i] = accumulate ? out[i] + v : v;
    }
  });
}

void lora_mask_blocks(float* b, int64_t rows, int64_t rank, int blocks, const int64_t* row_begin,
                      const int64_t* row_end) {
  const int64_t cols = rank * blocks;
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t k = c / rank;
      if (o < row_begin[k] || o >= row_end[k]) b[o * cols + c] = 0.0f;
    }
}

}  // namespace forge::cpu
