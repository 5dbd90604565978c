// Nearest 2x upsampling of NHWC activations: each output row copies the channel runs of its
// source row's pixels twice each; rows are split across threads.
#include "kernels/cpu/upsample.h"

#include <algorithm>
#include <cstring>

#include "core/parallel.h"

namespace forge::cpu {

void upsample_nearest2x(float* out, const float* in, int64_t batch, int64_t height, int64_t width, int64_t channels) {
  const int64_t rows = batch * 2 * height, bytes = channels * static_cast<int64_t>(sizeof(float));
  parallel_for(rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, width * channels)),
               [&](int64_t begin, int64_t end) {
                 for (int64_t r = begin; r < end; ++r) {
                   const int64_t b = r / (2 * height), y = r % (2 * height) / 2;
                   const float* src = in + (b * height + y) * width * channels;
                   float* dst = out + r * 2 * width * channels;
                   for (int64_t x = 0; x < 2 * width; ++x)
                     std::memcpy(dst + x * channels, src + x / 2 * channels, static_cast<size_t>(bytes));
                 }
               });
}

}  // namespace forge::cpu
