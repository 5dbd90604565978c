// Element types shared by the CUDA kernels' host-facing headers. Host code sees bf16 as
// an opaque 2-byte type; the .cu files see CUDA's __nv_bfloat16 with arithmetic.
#pragma once

#include <cuda_bf16.h>

namespace forge::cuda {

using bf16 = __nv_bfloat16;

}  // namespace forge::cuda
