// SwiGLU on the GPU: out = silu(g) * u over the fused gate/up projection [rows, 2F].
// Pure elementwise and memory-bound: each thread handles 8 consecutive columns with
// 16-byte loads of g and u and a 16-byte store, computing in fp32. The backward reads
// g, u and dout once and writes dg and du:
//   dg = dout * u * s * (1 + g (1 - s)),  du = dout * g * s,   s = sigmoid(g).
// Assumes F is a multiple of 8.
// With an FP8 epilogue (NOTE [FP8 fused producers] in ops/fp8_linear.h) the forward also
// folds the amax of its output (and writes its E4M3 codes when asked) and the backward the
// amax of dgate_up, both halves, from the rounded bf16 values in registers: the down
// projection's input and the gate/up projection's output gradient need no amax pass of
// their own. Threads past the end then stay for the block's reduction instead of leaving.
#include "kernels/cuda/swiglu.h"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fp8_device.cuh"

namespace forge::cuda {
namespace {

__global__ void swiglu_forward_kernel(bf16* out, const bf16* gate_up, int64_t rows, int64_t ffn, Fp8Epilogue fp8) {
  int64_t chunks_per_row = ffn / 8;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned amax_bits = 0;
  if (i < rows * chunks_per_row) {
    int64_t row = i / chunks_per_row, col = (i % chunks_per_row) * 8;
    const bf16* g = gate_up + row * 2 * ffn + col;
    uint4 ga = *reinterpret_cast<const uint4*>(g), ua = *reinterpret_cast<const uint4*>(g + ffn);
    const bf16 *gv = reinterpret_cast<const bf16*>(&ga), *uv = reinterpret_cast<const bf16*>(&ua);
    uint4 oa;
    bf16* ov = reinterpret_cast<bf16*>(&oa);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float gf = __bfloat162float(gv[k]);
      ov[k] = __float2bfloat16(gf / (1.f + __expf(-gf)) * __bfloat162float(uv[k]));
    }
    *reinterpret_cast<uint4*>(out + row * ffn + col) = oa;
    if (fp8.amax) fp8_epilogue8(fp8, oa, row * ffn + col, amax_bits);
  }
  if (fp8.amax) block_max_into(amax_bits, fp8.amax);
}

__global__ void swiglu_backward_kernel(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t rows,
                                       int64_t ffn, float* amax) {
  int64_t chunks_per_row = ffn / 8;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned amax_bits = 0;
  if (i < rows * chunks_per_row) {
    int64_t row = i / chunks_per_row, col = (i % chunks_per_row) * 8;
    const bf16* g = gate_up + row * 2 * ffn + col;
    uint4 ga = *reinterpret_cast<const uint4*>(g), ua = *reinterpret_cast<const uint4*>(g + ffn),
          da = *reinterpret_cast<const uint4*>(dout + row * ffn + col);
    const bf16 *gv = reinterpret_cast<const bf16*>(&ga), *uv = reinterpret_cast<const bf16*>(&ua),
               *dv = reinterpret_cast<const bf16*>(&da);
    uint4 dga, dua;
    bf16 *dgv = reinterpret_cast<bf16*>(&dga), *duv = reinterpret_cast<bf16*>(&dua);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float gf = __bfloat162float(gv[k]), uf = __bfloat162float(uv[k]), d = __bfloat162float(dv[k]);
      float s = 1.f / (1.f + __expf(-gf));
      dgv[k] = __float2bfloat16(d * uf * s * (1.f + gf * (1.f - s)));
      duv[k] = __float2bfloat16(d * gf * s);
      if (amax) amax_bits = max(amax_bits, max(abs_bits(__bfloat162float(dgv[k])), abs_bits(__bfloat162float(duv[k]))));
    }
    bf16* dg = dgate_up + row * 2 * ffn + col;
    *reinterpret_cast<uint4*>(dg) = dga;
    *reinterpret_cast<uint4*>(dg + ffn) = dua;
  }
  if (amax) block_max_into(amax_bits, amax);
}

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace

void swiglu_forward(bf16* out, const bf16* gate_up, int64_t rows, int64_t ffn, const Fp8Epilogue& fp8) {
  FORGE_CHECK(ffn % 8 == 0, "swiglu: ffn {} must be a multiple of 8 on CUDA", ffn);
  int64_t n = rows * ffn / 8;
  if (n) swiglu_forward_kernel<<<blocks_for(n, 256), 256>>>(out, gate_up, rows, ffn, fp8);
  FORGE_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t rows, int64_t ffn,
                     float* amax) {
  FORGE_CHECK(ffn % 8 == 0, "swiglu: ffn {} must be a multiple of 8 on CUDA", ffn);
  int64_t n = rows * ffn / 8;
  if (n) swiglu_backward_kernel<<<blocks_for(n, 256), 256>>>(dgate_up, dout, gate_up, rows, ffn, amax);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
