#pragma once

#include <cstdint>

#include "kernels/cuda/fp8_epilogue.h"
#include "kernels/cuda/types.h"

namespace forge::cuda {

// gate_up bf16 [rows, 2F] (gate | up), out bf16 [rows, F]; with an active `fp8`, out's
// amax (and codes) as Fp8Epilogue says, in the same pass.
void swiglu_forward(bf16* out, const bf16* gate_up, int64_t rows, int64_t ffn, const Fp8Epilogue& fp8 = {});
// Overwrites dgate_up bf16 [rows, 2F] from dout bf16 [rows, F]; with amax not null, max
// |dgate_up| is folded into it (NaN winning).
void swiglu_backward(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t rows, int64_t ffn,
                     float* amax = nullptr);

}  // namespace forge::cuda
