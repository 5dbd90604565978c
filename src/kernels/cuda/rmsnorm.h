#pragma once

#include <cstdint>

#include "kernels/cuda/fp8_epilogue.h"
#include "kernels/cuda/types.h"

namespace forge::cuda {

// x, y, dx, dy are bf16 [rows, dim]; weight is bf16 [dim]; rstd fp32 [rows]; dweight fp32 [dim].
// With an active `fp8`, y's amax (and codes) as Fp8Epilogue says, in the same pass.
void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* weight, int64_t rows, int64_t dim, float eps,
                     const Fp8Epilogue& fp8 = {});
// Accumulates: dx += d(loss)/dx (bf16), dweight += d(loss)/dweight (fp32).
void rmsnorm_backward(bf16* dx, float* dweight, const bf16* dy, const bf16* x, const bf16* weight,
                      const float* rstd, int64_t rows, int64_t dim);

}  // namespace forge::cuda
