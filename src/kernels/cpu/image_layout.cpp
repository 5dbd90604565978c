// [B, C, P] <-> [B, P, C] transposes (P = H W pixels), one sample's matrix at a time, its
// output rows split across threads.
#include "kernels/cpu/image_layout.h"

#include <algorithm>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

// out[b, i, j] = in[b, j, i] for in [batch, rows, cols].
void transpose(float* out, const float* in, int64_t batch, int64_t rows, int64_t cols) {
  parallel_for(batch * cols, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, rows)), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / cols, j = task % cols;
      const float* src = in + b * rows * cols + j;
      float* dst = out + task * rows;
      for (int64_t i = 0; i < rows; ++i) dst[i] = src[i * cols];
    }
  });
}

}  // namespace

void nhwc_from_nchw(float* out, const float* in, int64_t batch, int64_t channels, int64_t pixels) {
  transpose(out, in, batch, channels, pixels);
}

void nchw_from_nhwc(float* out, const float* in, int64_t batch, int64_t channels, int64_t pixels) {
  transpose(out, in, batch, pixels, channels);
}

}  // namespace forge::cpu
