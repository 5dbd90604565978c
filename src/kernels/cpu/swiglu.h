#pragma once

#include <cstdint>

namespace forge::cpu {

// gate_up and dgate_up are [rows, 2 * ffn]; out and dout are [rows, ffn].
void swiglu_forward(float* out, const float* gate_up, int64_t rows, int64_t ffn);
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t rows, int64_t ffn);

}  // namespace forge::cpu
