// Rotary embeddings on the GPU, in place on the packed QKV projection output, in the
// rotate-half convention (pairs (i, i + D/2)). One thread per pair: it reads x[i] and
// x[i + D/2] of one head at one position, rotates them in fp32 by the angle from the fp32
// cos/sin tables, and writes both back. The backward is the same kernel with sin negated.
// Only the first `rotated_heads` heads of each position (the q and k heads) are touched;
// the v heads that follow are left alone.
#include "kernels/cuda/rope.h"

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

__global__ void rope_kernel(bf16* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                            int64_t rotated_heads, const float* cos, const float* sin, float sign) {
  int64_t half = head_dim / 2;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t total = batch * seq * rotated_heads * half;
  if (i >= total) return;
  int64_t pair = i % half;
  int64_t head = (i / half) % rotated_heads;
  int64_t token = i / (half * rotated_heads);  // b * seq + t
  int64_t t = token % seq;
  bf16* v = x + (token * heads + head) * head_dim;
  float c = cos[t * half + pair], s = sign * sin[t * half + pair];
  float a = __bfloat162float(v[pair]), b = __bfloat162float(v[pair + half]);
  v[pair] = __float2bfloat16(a * c - b * s);
  v[pair + half] = __float2bfloat16(b * c + a * s);
}

}  // namespace

void rope_rotate(bf16* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t rotated_heads,
                 const float* cos, const float* sin, bool inverse) {
  int64_t total = batch * seq * rotated_heads * (head_dim / 2);
  if (total)
    rope_kernel<<<static_cast<unsigned>((total + 255) / 256), 256>>>(x, batch, seq, heads, head_dim, rotated_heads,
                                                                     cos, sin, inverse ? -1.f : 1.f);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
