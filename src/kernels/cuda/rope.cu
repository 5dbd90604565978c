// Rotary embeddings on the GPU, in place on the packed QKV projection output, in the
// rotate-half convention (pairs (i, i + D/2)). One thread per two adjacent pairs: it reads
// x[i, i+1] and x[i + D/2, i + D/2 + 1] of one head at one position as bf16x2 words,
// rotates them in fp32 by the angles from the fp32 cos/sin tables, and writes both back.
// Index arithmetic is 32-bit (the host checks the element count fits), which matters: the
// op moves little data, and 64-bit divisions would dominate it. The backward is the same
// kernel with sin negated. The position is the token's index in its row, or the one given
// per token (packed examples restart at 0). Assumes head_dim is a multiple of 4 (checked on the host).
// Only the first `rotated_heads` heads of each position (the q and k heads) are touched;
// the v heads that follow are left alone.
#include "kernels/cuda/rope.h"

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

__global__ void rope_kernel(bf16* x, int total, int seq, int heads, int head_dim, int rotated_heads,
                            const float* cos, const float* sin, const int32_t* positions, float sign) {
  const int half = head_dim / 2, quarter = head_dim / 4;
  int i = blockIdx.x * blockDim.x + threadIdx.x;  // one of total = tokens * rotated_heads * quarter
  if (i >= total) return;
  const int pair = (i % quarter) * 2;
  const int rest = i / quarter;
  const int head = rest % rotated_heads;
  const int token = rest / rotated_heads;  // b * seq + t
  const int t = positions ? positions[token] : token % seq;
  __nv_bfloat162* lo = reinterpret_cast<__nv_bfloat162*>(x + (static_cast<int64_t>(token) * heads + head) * head_dim + pair);
  __nv_bfloat162* hi = lo + half / 2;
  const float2 c = *reinterpret_cast<const float2*>(cos + t * half + pair);
  const float2 s = *reinterpret_cast<const float2*>(sin + t * half + pair);
  const float2 a = __bfloat1622float2(*lo), b = __bfloat1622float2(*hi);
  *lo = __floats2bfloat162_rn(a.x * c.x - b.x * sign * s.x, a.y * c.y - b.y * sign * s.y);
  *hi = __floats2bfloat162_rn(b.x * c.x + a.x * sign * s.x, b.y * c.y + a.y * sign * s.y);
}

}  // namespace

void rope_rotate(bf16* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t rotated_heads,
                 const float* cos, const float* sin, const int32_t* positions, bool inverse) {
  FORGE_CHECK(head_dim % 4 == 0, "rope: head_dim {} must be a multiple of 4 on CUDA", head_dim);
  const int64_t total = batch * seq * rotated_heads * (head_dim / 4);
  FORGE_CHECK(batch * seq * heads * head_dim < (int64_t{1} << 31), "rope: {} x {} x {} x {} elements exceed 2^31",
              batch, seq, heads, head_dim);
  if (total)
    rope_kernel<<<static_cast<unsigned>((total + 255) / 256), 256>>>(
        x, static_cast<int>(total), static_cast<int>(seq), static_cast<int>(heads), static_cast<int>(head_dim),
        static_cast<int>(rotated_heads), cos, sin, positions, inverse ? -1.f : 1.f);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
