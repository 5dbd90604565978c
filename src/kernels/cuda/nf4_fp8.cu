// QLoRA's frozen NF4 base under precision.fp8: the E4M3 codes of a weight made straight
// from its NF4 codes (NOTE [FP8 straight from NF4] in ops/nf4_fp8.h), where the unfused path
// dequantizes to a bf16 copy (nf4.cu: 0.5 byte read, 2 written per weight), takes its amax
// (2 read) and casts it (2 read, 1 written).
//
// Each weight's value is made exactly as nf4_dequantize makes it (nf4_device.cuh: the
// block's absmax, the fp32 product, rounded to nearest-even bf16), and then treated exactly
// as fp8_amax and fp8_cast treat a bf16 value (fp8_device.cuh: the amax as unsigned bits,
// NaN above +inf; the product with the scale rounded once, the saturating cast). So the
// codes and the amax are the unfused path's bit for bit, for 0.5 byte read per weight for
// the amax and 0.5 read plus 1 written for the cast.
//
// Each thread takes 16 consecutive weights (one 8-byte load of codes), all in one block of
// 64, so it rebuilds one absmax; the cast writes its 16 codes with one 16-byte store. The
// amax pass loops grid-stride over the weights and folds each block's maximum into the
// device float with one atomic (it accumulates: a fused projection's parts fold into one
// amax). A thread whose weights run past n, or buffers not aligned for vector access, take
// the scalar path.
#include "kernels/cuda/nf4_fp8.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fp8_device.cuh"
#include "kernels/cuda/nf4_device.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPerThread = 16;

struct Nf4Source {
  const uint8_t* codes;
  const uint8_t* absmax_codes;
  const float* absmax_scales;
  float absmax_offset;
  int64_t n;
};

// The bf16 values of weights [first, first + 16) (those below n) into v; returns how many.
__device__ __forceinline__ int nf4_values16(const Nf4Source& s, const float* nf4, const float* dynamic, int64_t first,
                                            bool vector_ok, float* v) {
  const float absmax = nf4_block_absmax(dynamic, s.absmax_codes, s.absmax_scales, s.absmax_offset, first / 64);
  if (vector_ok && first + kPerThread <= s.n) {
    const uint2 packed = *reinterpret_cast<const uint2*>(s.codes + first / 2);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&packed);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[2 * k] = nf4_weight(nf4, bytes[k], true, absmax);
      v[2 * k + 1] = nf4_weight(nf4, bytes[k], false, absmax);
    }
    return static_cast<int>(kPerThread);
  }
  int count = 0;
  for (int64_t i = first; i < s.n && i < first + kPerThread; ++i)
    v[count++] = nf4_weight(nf4, s.codes[i / 2], i % 2 == 0, absmax);
  return count;
}

__global__ void nf4_fp8_amax_kernel(Nf4Source s, Nf4CodeTables tables, float* amax) {
  __shared__ float nf4[16];
  __shared__ float dynamic[256];
  nf4_stage_tables(tables, nf4, dynamic);
  const bool vector_ok = reinterpret_cast<uintptr_t>(s.codes) % 8 == 0;
  unsigned mine = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kPerThread;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread; first < s.n;
       first += stride) {
    float v[kPerThread];
    const int count = nf4_values16(s, nf4, dynamic, first, vector_ok, v);
    for (int k = 0; k < count; ++k) mine = max(mine, abs_bits(v[k]));
  }
  block_max_into(mine, amax);
}

__global__ void nf4_fp8_cast_kernel(Nf4Source s, Nf4CodeTables tables, const float* scale_ptr, uint8_t* out,
                                    float* amax) {
  __shared__ float nf4[16];
  __shared__ float dynamic[256];
  nf4_stage_tables(tables, nf4, dynamic);
  const bool vector_ok =
      reinterpret_cast<uintptr_t>(s.codes) % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const float scale = *scale_ptr;
  unsigned mine = 0;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread;
  if (first < s.n) {
    float v[kPerThread];
    const int count = nf4_values16(s, nf4, dynamic, first, vector_ok, v);
    if (count == kPerThread && vector_ok) {
      uint4 codes;
      uint8_t* bytes = reinterpret_cast<uint8_t*>(&codes);
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        mine = max(mine, abs_bits(v[k]));
        bytes[k] = cast_saturated<Fp8Format::E4M3>(__fmul_rn(v[k], scale));
      }
      *reinterpret_cast<uint4*>(out + first) = codes;
    } else {
      for (int k = 0; k < count; ++k) {
        mine = max(mine, abs_bits(v[k]));
        out[first + k] = cast_saturated<Fp8Format::E4M3>(__fmul_rn(v[k], scale));
      }
    }
  }
  if (amax) block_max_into(mine, amax);
}

unsigned blocks_for(int64_t n) {
  const int64_t threads = (n + kPerThread - 1) / kPerThread;
  return static_cast<unsigned>(std::max<int64_t>((threads + kThreads - 1) / kThreads, 1));
}

}  // namespace

void nf4_fp8_amax(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales, float absmax_offset,
                  int64_t n, float* amax, CudaStream stream) {
  if (n == 0) return;
  static const Nf4CodeTables tables = nf4_code_tables();
  nf4_fp8_amax_kernel<<<std::min(blocks_for(n), 132u * 16u), kThreads, 0, stream>>>(
      {codes, absmax_codes, absmax_scales, absmax_offset, n}, tables, amax);
  FORGE_CUDA_LAUNCH_CHECK();
}

void nf4_fp8_cast(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales, float absmax_offset,
                  int64_t n, const float* scale, uint8_t* out, float* amax, CudaStream stream) {
  if (n == 0) return;
  static const Nf4CodeTables tables = nf4_code_tables();
  nf4_fp8_cast_kernel<<<blocks_for(n), kThreads, 0, stream>>>({codes, absmax_codes, absmax_scales, absmax_offset, n},
                                                             tables, scale, out, amax);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
