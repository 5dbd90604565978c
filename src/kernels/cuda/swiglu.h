#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// gate_up bf16 [rows, 2F] (gate | up), out bf16 [rows, F].
void swiglu_forward(bf16* out, const bf16* gate_up, int64_t rows, int64_t ffn);
// Overwrites dgate_up bf16 [rows, 2F] from dout bf16 [rows, F].
void swiglu_backward(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int64_t rows, int64_t ffn);

}  // namespace forge::cuda
