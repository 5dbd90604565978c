// Multi-head Latent Attention's packed Q/K/V rows on the GPU (NOTE [MLA packed QKV] in
// ops/latent_attention.h; the CPU reference is kernels/cpu/latent_attention.cpp): the
// query heads q_nope | rope(q_pe), the key heads k_nope | rope(k_pe) with the one k_pe
// broadcast, the value heads, and the backward that gathers them back.
//
// The op is a copy with a rotation in it, memory-bound: at DeepSeek-V3's dims with 16 heads
// a token's packed row is 16 KB of bf16 written from 14 KB read. One block per token; its
// threads walk the row in 16-byte vectors of 8 bf16 (bf16x8.cuh), consecutive threads on
// consecutive vectors of a head, so a warp's accesses are coalesced. Three loops per block:
// the nope vectors (query and key, same index space), the rope units, the value vectors. A
// rope unit is 8 pairs (x[i], x[i + dr/2]): the vector at i and the one half a rope part
// further, rotated in fp32 with the 8 cos and 8 sin of the token's position (two float4
// loads from each fp32 table row), as kernels/cuda/rope.cu does in pairs. The key rope
// parts are the same rotation of k_pe for every head: each head's thread recomputes it from
// k_pe (its few hundred bytes stay in cache) rather than sharing it through shared memory,
// which would cost a barrier for 16 multiplies. Index arithmetic within a row is 32-bit, row
// offsets 64-bit.
// The backward copies the nope and value gradients back, rotates the query rope gradients
// back (sin negated), and gives k_pe the sum of its H copies' gradients: one thread per
// rope unit of the token adds the H heads' vectors in fp32 in head order, rotates the sum
// back and rounds once to bf16. Each output element has one writer and a fixed order, no
// atomics, so the result is the same bits every run; the fp32 sum is the CPU reference's
// exactly (same values, same order), the rotation after it differs from the CPU's only
// by the GPU's fused multiply-adds.
// Assumes nope_dim, v_dim and kv_rank multiples of 8, rope_dim a multiple of 16, every
// buffer 16-byte aligned (checked on the host), and positions within the tables (the
// caller's duty, as for rope).
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/latent_attention.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 256;  // threads per block (one token)

// A token's row layouts in 8-element vectors.
struct MlaVectors {
  int heads;
  int nope;       // nope_dim / 8
  int rope_half;  // rope_dim / 16: vectors in each half of a rope part (rope units per head)
  int v;          // v_dim / 8
  int kv_rank;    // kv_rank / 8
  int seq;
  __device__ int qk() const { return nope + 2 * rope_half; }
  __device__ int kv() const { return nope + v; }
  __device__ int packed() const { return heads * (2 * qk() + v); }
};

// The 8 fp32 values at table[0, 8) (a table row's angles for one rope unit).
__device__ __forceinline__ void load_angles(const float* __restrict__ table, float (&out)[8]) {
  const float4 a = reinterpret_cast<const float4*>(table)[0];
  const float4 b = reinterpret_cast<const float4*>(table)[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// The pairs (a[i], b[i]) rotated by the angles whose cos and sin are c and sign * s, in
// fp32, rounded once to bf16 into (lo, hi).
__device__ __forceinline__ void rotate_into(uint4& lo, uint4& hi, const float (&a)[8], const float (&b)[8],
                                            const float (&c)[8], const float (&s)[8], float sign) {
  float x[8], y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float si = sign * s[i];
    x[i] = a[i] * c[i] - b[i] * si;
    y[i] = b[i] * c[i] + a[i] * si;
  }
  lo = pack8(x);
  hi = pack8(y);
}

// The rope unit (lo, hi) rotated in place.
__device__ __forceinline__ void rotate(uint4& lo, uint4& hi, const float (&c)[8], const float (&s)[8], float sign) {
  float a[8], b[8];
  unpack8(lo, a);
  unpack8(hi, b);
  rotate_into(lo, hi, a, b, c, s, sign);
}

__device__ __forceinline__ int position_of(int64_t token, const int32_t* positions, int seq) {
  return positions ? positions[token] : static_cast<int>(token % seq);
}

__global__ void __launch_bounds__(kMaxThreads)
    pack_kernel(uint4* __restrict__ qkv, const uint4* __restrict__ q, const uint4* __restrict__ kv_a,
                const uint4* __restrict__ kv, const float* __restrict__ cos, const float* __restrict__ sin,
                const int32_t* __restrict__ positions, MlaVectors d) {
  const int64_t n = blockIdx.x;
  const int qk = d.qk(), half = 8 * d.rope_half;
  const int t = position_of(n, positions, d.seq);
  uint4* row = qkv + n * d.packed();
  uint4* keys = row + d.heads * qk;
  uint4* values = keys + d.heads * qk;
  const uint4* q_row = q + n * d.heads * qk;
  const uint4* kv_row = kv + n * d.heads * d.kv();
  const uint4* k_pe = kv_a + n * (d.kv_rank + 2 * d.rope_half) + d.kv_rank;

  for (int u = threadIdx.x; u < d.heads * d.nope; u += blockDim.x) {
    const int h = u / d.nope, j = u - h * d.nope;
    row[h * qk + j] = q_row[h * qk + j];
    keys[h * qk + j] = kv_row[h * d.kv() + j];
  }
  for (int u = threadIdx.x; u < d.heads * d.rope_half; u += blockDim.x) {
    const int h = u / d.rope_half, j = u - h * d.rope_half;
    float c[8], s[8];
    load_angles(cos + t * half + 8 * j, c);
    load_angles(sin + t * half + 8 * j, s);
    const int at = h * qk + d.nope + j;
    uint4 lo = q_row[at], hi = q_row[at + d.rope_half];
    rotate(lo, hi, c, s, 1.f);
    row[at] = lo;
    row[at + d.rope_half] = hi;
    lo = k_pe[j];
    hi = k_pe[j + d.rope_half];
    rotate(lo, hi, c, s, 1.f);
    keys[at] = lo;
    keys[at + d.rope_half] = hi;
  }
  for (int u = threadIdx.x; u < d.heads * d.v; u += blockDim.x) {
    const int h = u / d.v, j = u - h * d.v;
    values[u] = kv_row[h * d.kv() + d.nope + j];
  }
}

__global__ void __launch_bounds__(kMaxThreads)
    pack_backward_kernel(uint4* __restrict__ d_q, uint4* __restrict__ d_kv_a, uint4* __restrict__ d_kv,
                         const uint4* __restrict__ d_qkv, const float* __restrict__ cos,
                         const float* __restrict__ sin, const int32_t* __restrict__ positions, MlaVectors d) {
  const int64_t n = blockIdx.x;
  const int qk = d.qk(), half = 8 * d.rope_half;
  const int t = position_of(n, positions, d.seq);
  const uint4* row = d_qkv + n * d.packed();
  const uint4* keys = row + d.heads * qk;
  const uint4* values = keys + d.heads * qk;
  uint4* dq_row = d_q + n * d.heads * qk;
  uint4* dkv_row = d_kv + n * d.heads * d.kv();
  uint4* d_k_pe = d_kv_a + n * (d.kv_rank + 2 * d.rope_half) + d.kv_rank;

  // k_pe's gradient first: its threads have the longest chain (H vectors per half).
  for (int j = threadIdx.x; j < d.rope_half; j += blockDim.x) {
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int h = 0; h < d.heads; ++h) {
      const int at = h * qk + d.nope + j;
      float x[8], y[8];
      unpack8(keys[at], x);
      unpack8(keys[at + d.rope_half], y);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        a[i] = a[i] + x[i];
        b[i] = b[i] + y[i];
      }
    }
    float c[8], s[8];
    load_angles(cos + t * half + 8 * j, c);
    load_angles(sin + t * half + 8 * j, s);
    uint4 lo, hi;
    rotate_into(lo, hi, a, b, c, s, -1.f);
    d_k_pe[j] = lo;
    d_k_pe[j + d.rope_half] = hi;
  }
  for (int u = threadIdx.x; u < d.heads * d.nope; u += blockDim.x) {
    const int h = u / d.nope, j = u - h * d.nope;
    dq_row[h * qk + j] = row[h * qk + j];
    dkv_row[h * d.kv() + j] = keys[h * qk + j];
  }
  for (int u = threadIdx.x; u < d.heads * d.rope_half; u += blockDim.x) {
    const int h = u / d.rope_half, j = u - h * d.rope_half;
    float c[8], s[8];
    load_angles(cos + t * half + 8 * j, c);
    load_angles(sin + t * half + 8 * j, s);
    const int at = h * qk + d.nope + j;
    uint4 lo = row[at], hi = row[at + d.rope_half];
    rotate(lo, hi, c, s, -1.f);
    dq_row[at] = lo;
    dq_row[at + d.rope_half] = hi;
  }
  for (int u = threadIdx.x; u < d.heads * d.v; u += blockDim.x) {
    const int h = u / d.v, j = u - h * d.v;
    dkv_row[h * d.kv() + d.nope + j] = values[u];
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The vector layout of the dims, after checking what the kernels assume of them and of
// the buffers.
MlaVectors check_layout(const char* op, int64_t batch, int64_t seq, int64_t heads, int64_t nope_dim, int64_t rope_dim,
                        int64_t v_dim, int64_t kv_rank, std::initializer_list<const void*> buffers) {
  FORGE_CHECK(heads >= 1 && nope_dim >= 0 && nope_dim % 8 == 0 && v_dim >= 8 && v_dim % 8 == 0 && rope_dim >= 16 &&
                  rope_dim % 16 == 0 && kv_rank >= 0 && kv_rank % 8 == 0,
              "{}: on CUDA nope_dim {}, v_dim {} and kv_rank {} must be multiples of 8 (v_dim positive) and rope_dim "
              "{} a positive multiple of 16 (16-byte vectors), heads {} positive",
              op, nope_dim, v_dim, kv_rank, rope_dim, heads);
  const int64_t packed = heads * (2 * (nope_dim + rope_dim) + v_dim);
  FORGE_CHECK(batch >= 0 && seq >= 0 && batch * seq <= INT32_MAX && packed <= INT32_MAX && kv_rank + rope_dim <= INT32_MAX,
              "{}: {} x {} tokens of {} packed columns exceed the kernels' 32-bit indices", op, batch, seq, packed);
  for (const void* p : buffers)
    FORGE_CHECK(aligned16(p), "{}: a buffer at {} is not 16-byte aligned (vectorized loads)", op, p);
  return MlaVectors{static_cast<int>(heads),        static_cast<int>(nope_dim / 8), static_cast<int>(rope_dim / 16),
                    static_cast<int>(v_dim / 8),    static_cast<int>(kv_rank / 8),  static_cast<int>(seq)};
}

// Threads per token block: the longest of the loops' vector counts rounded up to a warp,
// at most kMaxThreads.
int threads_for(const MlaVectors& d) {
  const int64_t work = std::max({d.heads * d.nope, d.heads * d.rope_half, d.heads * d.v});
  const int64_t rounded = (work + kWarp - 1) / kWarp * kWarp;
  return static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(kWarp, rounded)));
}

}  // namespace

void mla_pack_qkv(bf16* qkv, const bf16* q, const bf16* kv_a, const bf16* kv, int64_t batch, int64_t seq,
                  int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t kv_rank, const float* cos,
                  const float* sin, const int32_t* positions) {
  const MlaVectors d =
      check_layout("mla_pack_qkv", batch, seq, heads, nope_dim, rope_dim, v_dim, kv_rank, {qkv, q, kv_a, kv, cos, sin});
  if (batch * seq == 0) return;
  pack_kernel<<<static_cast<unsigned>(batch * seq), threads_for(d)>>>(
      reinterpret_cast<uint4*>(qkv), reinterpret_cast<const uint4*>(q), reinterpret_cast<const uint4*>(kv_a),
      reinterpret_cast<const uint4*>(kv), cos, sin, positions, d);
  FORGE_CUDA_LAUNCH_CHECK();
}

void mla_pack_qkv_backward(bf16* d_q, bf16* d_kv_a, bf16* d_kv, const bf16* d_qkv, int64_t batch, int64_t seq,
                           int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t kv_rank,
                           const float* cos, const float* sin, const int32_t* positions) {
  const MlaVectors d = check_layout("mla_pack_qkv_backward", batch, seq, heads, nope_dim, rope_dim, v_dim, kv_rank,
                                    {d_q, d_kv_a, d_kv, d_qkv, cos, sin});
  if (batch * seq == 0) return;
  pack_backward_kernel<<<static_cast<unsigned>(batch * seq), threads_for(d)>>>(
      reinterpret_cast<uint4*>(d_q), reinterpret_cast<uint4*>(d_kv_a), reinterpret_cast<uint4*>(d_kv),
      reinterpret_cast<const uint4*>(d_qkv), cos, sin, positions, d);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
