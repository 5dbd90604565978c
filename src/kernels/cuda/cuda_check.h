// Error checks for the CUDA backend: every runtime and library call is wrapped, and every
// kernel launch is followed by FORGE_CUDA_LAUNCH_CHECK, so a failure names its file:line
// instead of surfacing later as a wrong number.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.h"

#define CUDA_CHECK(expr)                                                                                   \
  do {                                                                                                     \
    cudaError_t forge_cuda_status = (expr);                                                                \
    if (forge_cuda_status != cudaSuccess)                                                                  \
      ::forge::throw_error(__FILE__, __LINE__,                                                             \
                           fmt::format("{}: {}", #expr, cudaGetErrorString(forge_cuda_status)));          \
  } while (0)

#define CUBLAS_CHECK(expr)                                                                                 \
  do {                                                                                                     \
    cublasStatus_t forge_cublas_status = (expr);                                                           \
    if (forge_cublas_status != CUBLAS_STATUS_SUCCESS)                                                      \
      ::forge::throw_error(__FILE__, __LINE__,                                                             \
                           fmt::format("{}: cuBLAS status {}", #expr, static_cast<int>(forge_cublas_status))); \
  } while (0)

#define FORGE_CUDA_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())
