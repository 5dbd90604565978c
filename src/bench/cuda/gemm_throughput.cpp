// GEMM throughput for preflight: bf16 through forge's own matmul (the op every linear
// layer of a training step calls, so the number is what training gets), and fp8 e4m3
// straight through cuBLASLt, which forge's ops do not use yet.
//
// The fp8 GEMM is set up as Hopper's fp8 tensor-core kernels require: both operands
// e4m3, the first transposed and the second not ("TN" in cuBLASLt's column-major terms;
// for a square random product the orientation does not change the work), fp32
// accumulation and scale, a bf16 output, and a device pointer to a per-tensor scale for
// each operand (1.0 here), which is how fp8 training passes its scaling factors. Fast
// accumulation stays off, as in torch._scaled_mm's default that PERF.md's ceiling used.
//
// Each scale lives in its own allocation. cuBLASLt 13 wants the scale pointers aligned
// like any operand: with the B scale 4 bytes after the A scale in one buffer, the
// heuristic still offers algorithms but every cublasLtMatmul call returns
// CUBLAS_STATUS_NOT_SUPPORTED (measured on H200, cuBLASLt 13.1; its header says a
// heuristic's success "doesn't fully guarantee algo will run ... e.g. buffers are not
// correctly aligned"). torch._scaled_mm never meets this: each scale is its own tensor.
// Should a cuBLASLt still refuse every candidate at run time, the measurement throws
// Fp8GemmUnsupported and preflight reports the check as skipped, not failed: the API's
// refusal says nothing about the GPU's health.
//
// Inputs are random bit patterns of moderate magnitude with every mantissa bit random:
// realistic switching power, no NaN or infinity, and no overflow of the bf16 output.
#include <cublasLt.h>

#include <algorithm>
#include <vector>

#include "bench/cuda/device_buffer.h"
#include "bench/cuda/event_timing.h"
#include "bench/preflight_measure.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "kernels/cuda/cuda_check.h"
#include "ops/matmul.h"

namespace forge {
namespace {

using bench_cuda::DeviceBuffer;

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// bf16 values of magnitude in [2^-7, 2): random sign and mantissa, exponent 120..127.
std::vector<uint16_t> random_bf16(size_t count, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> values(count);
  for (size_t i = 0; i < count; i += 4) {
    uint64_t bits = rng.next_u64();
    for (size_t j = i; j < std::min(count, i + 4); ++j, bits >>= 16) {
      const uint16_t sign = (bits >> 15) & 1, exponent = 120 + ((bits >> 7) & 7), mantissa = bits & 0x7f;
      values[j] = static_cast<uint16_t>(sign << 15 | exponent << 7 | mantissa);
    }
  }
  return values;
}

// e4m3 values of magnitude in [1/4, 4): random sign and mantissa, biased exponent 5..8
// (e4m3's only NaN has exponent and mantissa all ones).
std::vector<uint8_t> random_e4m3(size_t count, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint8_t> values(count);
  for (size_t i = 0; i < count; i += 8) {
    uint64_t bits = rng.next_u64();
    for (size_t j = i; j < std::min(count, i + 8); ++j, bits >>= 8) {
      const unsigned sign = (bits >> 7) & 1, exponent = 5 + ((bits >> 3) & 3);
      values[j] = static_cast<uint8_t>(sign << 7 | exponent << 3 | (bits & 7));
    }
  }
  return values;
}

double tflops(int64_t n, double seconds) { return 2.0 * static_cast<double>(n) * n * n / seconds / 1e12; }

// The cuBLASLt objects of one fp8 GEMM, destroyed together.
struct Fp8Gemm {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;

  ~Fp8Gemm() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    for (cublasLtMatrixLayout_t layout : {a, b, d}) {
      if (layout) cublasLtMatrixLayoutDestroy(layout);
    }
    if (op) cublasLtMatmulDescDestroy(op);
    if (handle) cublasLtDestroy(handle);
  }
};

}  // namespace

double measure_bf16_gemm_tflops(int gpu, int64_t n) {
  CUDA_CHECK(cudaSetDevice(gpu));
  const size_t count = static_cast<size_t>(n * n);
  Tensor a = Tensor::empty({n, n}, DType::BF16, Device::CUDA);
  Tensor b = Tensor::empty({n, n}, DType::BF16, Device::CUDA);
  Tensor out = Tensor::empty({n, n}, DType::BF16, Device::CUDA);
  CUDA_CHECK(cudaMemcpy(a.raw(), random_bf16(count, 1).data(), a.nbytes(), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(b.raw(), random_bf16(count, 2).data(), b.nbytes(), cudaMemcpyHostToDevice));
  // The forward GEMM of a linear layer: y = x W^T.
  const double seconds = bench_cuda::median_call_seconds({{gpu, nullptr}}, [&] { matmul(out, a, false, b, true); });
  return tflops(n, seconds);
}

double measure_fp8_gemm_tflops(int gpu, int64_t n) {
  CUDA_CHECK(cudaSetDevice(gpu));
  const size_t count = static_cast<size_t>(n * n);
  DeviceBuffer a(gpu, count), b(gpu, count), d(gpu, 2 * count), a_scale_buffer(gpu, sizeof(float)),
      b_scale_buffer(gpu, sizeof(float)), workspace(gpu, kWorkspaceBytes);
  CUDA_CHECK(cudaMemcpy(a.get(), random_e4m3(count, 3).data(), count, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(b.get(), random_e4m3(count, 4).data(), count, cudaMemcpyHostToDevice));
  const float one = 1.0f;
  CUDA_CHECK(cudaMemcpy(a_scale_buffer.get(), &one, sizeof(one), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(b_scale_buffer.get(), &one, sizeof(one), cudaMemcpyHostToDevice));
  const void* a_scale = a_scale_buffer.get();
  const void* b_scale = b_scale_buffer.get();

  Fp8Gemm g;
  CUBLAS_CHECK(cublasLtCreate(&g.handle));
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  // Column-major: A is stored k x m (used transposed), B k x n, D m x n.
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_8F_E4M3, n, n, n));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_8F_E4M3, n, n, n));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.d, CUDA_R_16BF, n, n, n));
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&g.preference));
  const size_t workspace_bytes = kWorkspaceBytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(g.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &workspace_bytes, sizeof(workspace_bytes)));
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t candidates[kCandidates]{};
  int found = 0;
  const cublasStatus_t heuristic_status = cublasLtMatmulAlgoGetHeuristic(
      g.handle, g.op, g.a, g.b, g.d, g.d, g.preference, kCandidates, candidates, &found);
  if (heuristic_status == CUBLAS_STATUS_NOT_SUPPORTED || (heuristic_status == CUBLAS_STATUS_SUCCESS && found == 0))
    throw Fp8GemmUnsupported(
        fmt::format("cuBLASLt {} offers no fp8 e4m3 algorithm for {}^3", cublasLtGetVersion(), n));
  CUBLAS_CHECK(heuristic_status);

  const float alpha = 1.0f, beta = 0.0f;
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(g.handle, g.op, &alpha, a.get(), g.a, b.get(), g.b, &beta, d.get(), g.d, d.get(), g.d, &algo,
                          workspace.get(), kWorkspaceBytes, nullptr);
  };
  // The first candidate, in the heuristic's order, that cuBLASLt actually runs.
  const cublasLtMatmulAlgo_t* algo = nullptr;
  for (int i = 0; i < found && !algo; ++i) {
    const cublasStatus_t status = run(candidates[i].algo);
    if (status == CUBLAS_STATUS_SUCCESS) {
      algo = &candidates[i].algo;
    } else if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
      CUBLAS_CHECK(status);
    }
  }
  if (!algo)
    throw Fp8GemmUnsupported(fmt::format(
        "cuBLASLt {} returned CUBLAS_STATUS_NOT_SUPPORTED for each of the {} fp8 e4m3 algorithm(s) its heuristic "
        "offered",
        cublasLtGetVersion(), found));
  CUDA_CHECK(cudaDeviceSynchronize());

  const double seconds = bench_cuda::median_call_seconds({{gpu, nullptr}}, [&] { CUBLAS_CHECK(run(*algo)); });
  return tflops(n, seconds);
}

}  // namespace forge
