// The measurements behind forge preflight, implemented in bench/cuda/ and compiled only
// with the CUDA backend. Each selects its GPU, times its operation with CUDA events after
// a warm-up (cuda/event_timing.h) and returns the median over the measured iterations.
// Errors are thrown as forge::Error.
#pragma once

#include <cstddef>
#include <cstdint>

#include "bench/preflight.h"
#include "core/error.h"

namespace forge {

int visible_gpu_count();
GpuInfo query_gpu(int index);
// CUDA driver, CUDA runtime and NCCL versions; host and kernel driver are filled by the caller.
SystemInfo query_cuda_versions();

// Square n x n x n GEMMs on random data (zeros would draw less power and run faster than
// any real workload), fp32 accumulation, bf16 output. TFLOP/s = 2 n^3 / time.
double measure_bf16_gemm_tflops(int gpu, int64_t n);  // through forge's ops/matmul.h
double measure_fp8_gemm_tflops(int gpu, int64_t n);   // e4m3 x e4m3 through cuBLASLt

// Thrown by measure_fp8_gemm_tflops when cuBLASLt offers or runs no fp8 algorithm: a
// limit of the library in use, which preflight reports as "skipped", not as a failure.
class Fp8GemmUnsupported : public Error {
 public:
  using Error::Error;
};

// cudaMemcpyAsync of `bytes` within one GPU; GB/s of HBM traffic = 2 x bytes / time, since
// every byte is read once and written once (the convention of PERF.md's copy ceilings).
double measure_device_copy_gbps(int gpu, size_t bytes);
// cudaMemcpyAsync of `bytes` from page-locked host memory; GB/s = bytes / time.
double measure_host_to_device_gbps(int gpu, size_t bytes);

// Bus bandwidth (bus_bandwidth.h) of bf16 sum all-reduce over a `bytes` buffer and of
// all-gather into a `bytes` buffer, on GPUs 0..n_gpus-1 in one process (ncclCommInitAll,
// one group call launching every GPU's part). GB/s.
struct CollectiveBandwidth {
  double allreduce_bus_gbps = 0;
  double allgather_bus_gbps = 0;
};
CollectiveBandwidth measure_nccl_bus_bandwidth(int n_gpus, size_t bytes);

}  // namespace forge
