// SwiGLU, the gated activation of the Llama MLP, on the fused gate/up projection output.
//
// Per row, the gate g is the first half of the columns and the up projection u the second:
//   out = silu(g) * u,  silu(g) = g * s,  s = sigmoid(g) = 1 / (1 + exp(-g))
//   du  = dout * silu(g)
//   dg  = dout * u * s * (1 + g * (1 - s))        (the derivative of g * sigmoid(g))
// For very negative g, exp(-g) overflows to inf and s becomes exactly 0, which is the
// right limit for every expression above. Rows are independent and split across threads.
#include "kernels/cpu/swiglu.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

int64_t rows_per_chunk(int64_t ffn) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(ffn, 1)); }

}  // namespace

void swiglu_forward(float* out, const float* gate_up, int64_t rows, int64_t ffn) {
  parallel_for(rows, rows_per_chunk(ffn), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* g = gate_up + n * 2 * ffn;
      const float* u = g + ffn;
      float* o = out + n * ffn;
      for (int64_t f = 0; f < ffn; ++f) o[f] = g[f] * sigmoid(g[f]) * u[f];
    }
  });
}

void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t rows, int64_t ffn) {
  parallel_for(rows, rows_per_chunk(ffn), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* g = gate_up + n * 2 * ffn;
      const float* u = g + ffn;
      const float* d = dout + n * ffn;
      float* dg = dgate_up + n * 2 * ffn;
      float* du = dg + ffn;
      for (int64_t f = 0; f < ffn; ++f) {
        float s = sigmoid(g[f]);
        float gf = g[f], uf = u[f];
        du[f] = d[f] * gf * s;
        dg[f] = d[f] * uf * s * (1.0f + gf * (1.0f - s));
      }
    }
  });
}

}  // namespace forge::cpu
