// GroupNorm (+ SiLU) of NHWC bf16 activations on the GPU (ops/group_norm.h).
//
// A group's statistics cover every pixel of an image: at FLUX's 1024x1024 that is a million
// pixels x 4 to 16 channels, for only B x 32 groups, too few for one block each. So three
// kernels, none with atomics (the same bits every run):
//  1. per-channel moments of each chunk of kChunkPixels pixels: a block (32 channel lanes x 8
//     pixel rows) walks the chunk for each run of 32 channels, each thread keeping Welford's
//     running mean and sum of squared deviations (M2) of its channel over every 8th pixel in
//     fp32; the 8 rows are merged in order (Chan's pairwise formula) and the chunk's (mean,
//     M2) of the channel written to scratch. Loads are 32 consecutive channels of a pixel.
//  2. per (sample, group), one block merges the moments of the group's channels over all
//     chunks in double (counts reach 2^24 and beyond at large images), in a fixed order
//     (strided per thread, then a tree), and stores the mean and 1 / sqrt(var + eps).
//  3. the normalization, elementwise: 8 consecutive channels per thread (16-byte loads and
//     stores when the channels are a multiple of 8 and the pointers aligned),
//     y = (x - mean) rstd weight + bias, then SiLU. In place when out is in: each element is
//     read and written by one thread.
// Mean and M2 instead of sums of x and x^2: the VAE's activations can have a mean large
// against their spread, where E[x^2] - mean^2 in fp32 would lose the variance.
#include "kernels/cuda/group_norm.h"

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int kLanes = 32;          // channels per pass of a moments block
constexpr int kRows = 8;            // pixel rows of a moments block
constexpr int64_t kChunkPixels = 256;
constexpr int kMergeThreads = 256;
constexpr int kApplyThreads = 256;

struct Moments {
  double count, mean, m2;
};

// Chan et al.'s pairwise update: the moments of a and b together.
__device__ __forceinline__ Moments merge(Moments a, Moments b) {
  const double n = a.count + b.count;
  if (n == 0.0) return a;
  const double delta = b.mean - a.mean;
  return {n, a.mean + delta * b.count / n, a.m2 + b.m2 + delta * delta * a.count * b.count / n};
}

__device__ __forceinline__ int64_t chunk_count(int64_t chunk, int64_t pixels) {
  return min(kChunkPixels, pixels - chunk * kChunkPixels);
}

// partials[(b chunks + chunk) channels + c] = (mean, M2) of channel c over the chunk's pixels.
__global__ void channel_moments_kernel(float2* partials, const bf16* in, int64_t pixels, int64_t channels,
                                       int64_t chunks) {
  __shared__ float s_mean[kRows][kLanes], s_m2[kRows][kLanes];
  const int lane = threadIdx.x, row = threadIdx.y;
  const int64_t b = blockIdx.y, chunk = blockIdx.x;
  const int64_t first = chunk * kChunkPixels, last = first + chunk_count(chunk, pixels);
  const bf16* x = in + b * pixels * channels;
  for (int64_t c0 = 0; c0 < channels; c0 += kLanes) {
    const int64_t c = c0 + lane;
    float n = 0.f, mean = 0.f, m2 = 0.f;
    if (c < channels)
      for (int64_t p = first + row; p < last; p += kRows) {
        const float v = __bfloat162float(x[p * channels + c]);
        n += 1.f;
        const float delta = v - mean;
        mean += delta / n;
        m2 += delta * (v - mean);
      }
    s_mean[row][lane] = mean;
    s_m2[row][lane] = m2;
    __syncthreads();
    if (row == 0 && c < channels) {
      Moments total{0.0, 0.0, 0.0};
      for (int r = 0; r < kRows; ++r) {
        const int64_t count = max(int64_t{0}, (last - first - r + kRows - 1) / kRows);
        total = merge(total, {static_cast<double>(count), s_mean[r][lane], s_m2[r][lane]});
      }
      partials[(b * chunks + chunk) * channels + c] =
          make_float2(static_cast<float>(total.mean), static_cast<float>(total.m2));
    }
    __syncthreads();
  }
}

// stats[b groups + g] = (mean, rstd) of group g of sample b.
__global__ void group_statistics_kernel(float2* stats, const float2* partials, int64_t pixels, int64_t channels,
                                        int64_t groups, int64_t chunks, float eps) {
  __shared__ Moments s[kMergeThreads];
  const int64_t b = blockIdx.y, g = blockIdx.x, width = channels / groups;
  Moments m{0.0, 0.0, 0.0};
  for (int64_t i = threadIdx.x; i < chunks * width; i += kMergeThreads) {
    const int64_t chunk = i / width, c = g * width + i % width;
    const float2 p = partials[(b * chunks + chunk) * channels + c];
    m = merge(m, {static_cast<double>(chunk_count(chunk, pixels)), p.x, p.y});
  }
  s[threadIdx.x] = m;
  __syncthreads();
  for (int half = kMergeThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) s[threadIdx.x] = merge(s[threadIdx.x], s[threadIdx.x + half]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const Moments t = s[0];
    stats[b * groups + g] = make_float2(static_cast<float>(t.mean), static_cast<float>(rsqrt(t.m2 / t.count + eps)));
  }
}

__device__ __forceinline__ float normalize(float x, float2 stat, float w, float shift, bool silu) {
  const float y = (x - stat.x) * stat.y * w + shift;
  return silu ? y / (1.f + __expf(-y)) : y;
}

__global__ void apply_kernel(bf16* out, const bf16* in, const bf16* weight, const bf16* bias, const float2* stats,
                             int64_t pixels, int64_t channels, int64_t groups, int64_t total, bool silu, bool vector) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (first >= total) return;
  const int64_t width = channels / groups;
  if (vector) {  // the 8 elements are channels c .. c + 7 of one pixel
    const int64_t c = first % channels, b = first / (pixels * channels);
    float x[8], w[8], s[8];
    unpack8(*reinterpret_cast<const uint4*>(in + first), x);
    unpack8(*reinterpret_cast<const uint4*>(weight + c), w);
    unpack8(*reinterpret_cast<const uint4*>(bias + c), s);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = normalize(x[k], stats[b * groups + (c + k) / width], w[k], s[k], silu);
    *reinterpret_cast<uint4*>(out + first) = pack8(x);
    return;
  }
  for (int64_t i = first; i < total && i < first + 8; ++i) {
    const int64_t c = i % channels, b = i / (pixels * channels);
    out[i] = __float2bfloat16(normalize(__bfloat162float(in[i]), stats[b * groups + c / width],
                                        __bfloat162float(weight[c]), __bfloat162float(bias[c]), silu));
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void group_norm_forward(bf16* out, const bf16* in, const bf16* weight, const bf16* bias, int64_t batch, int64_t pixels,
                        int64_t channels, int64_t groups, float eps, bool silu) {
  const int64_t total = batch * pixels * channels;
  if (total == 0) return;
  const int64_t chunks = (pixels + kChunkPixels - 1) / kChunkPixels;
  auto* partials = static_cast<float2*>(scratch_buffer(
      ScratchSlot::GroupNormPartials, static_cast<size_t>(batch * chunks * channels) * sizeof(float2)));
  auto* stats = static_cast<float2*>(
      scratch_buffer(ScratchSlot::GroupNormStatistics, static_cast<size_t>(batch * groups) * sizeof(float2)));
  channel_moments_kernel<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(batch)), dim3(kLanes, kRows)>>>(
      partials, in, pixels, channels, chunks);
  FORGE_CUDA_LAUNCH_CHECK();
  group_statistics_kernel<<<dim3(static_cast<unsigned>(groups), static_cast<unsigned>(batch)), kMergeThreads>>>(
      stats, partials, pixels, channels, groups, chunks, eps);
  FORGE_CUDA_LAUNCH_CHECK();
  const bool vector = channels % 8 == 0 && aligned16(out) && aligned16(in) && aligned16(weight) && aligned16(bias);
  const auto blocks = static_cast<unsigned>(((total + 7) / 8 + kApplyThreads - 1) / kApplyThreads);
  apply_kernel<<<blocks, kApplyThreads>>>(out, in, weight, bias, stats, pixels, channels, groups, total, silu, vector);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
