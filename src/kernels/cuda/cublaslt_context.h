// The current GPU's cuBLASLt handle and the workspace its GEMMs share, for the cuBLASLt
// wrappers besides matmul.cpp (fp8_matmul.cpp). matmul.cpp owns them: one per GPU, made on
// first use, kept for the life of the process. All GEMMs run on one stream, so they can
// share the workspace.
#pragma once

#include <cublasLt.h>

#include <cstddef>

namespace forge::cuda {

struct CublasLtContext {
  cublasLtHandle_t handle;
  void* workspace;
  size_t workspace_bytes;
};

CublasLtContext cublaslt_context();

}  // namespace forge::cuda
