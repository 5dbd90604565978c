// Test helpers for the FP8 ops' CPU references: a tensor quantized tensorwise as torchao's
// recipe and read back in double, and a plain GEMM in double on such values.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/fp8_scaling.h"

namespace forge::testing {

// t [rows, cols] (fp32) quantized tensorwise (torchao's scale from its amax) and decoded, in double.
inline std::vector<double> fake_quantized(const Tensor& t, cpu::Fp8Format format) {
  const int64_t rows = t.dim(0), cols = t.dim(1);
  const cpu::Fp8Blocks whole{rows, cols};
  float amax = 0.0f;
  cpu::fp8_block_amax(t.data<float>(), rows, cols, whole, &amax);
  const float scale = cpu::fp8_scale_torchao(amax, format, false);
  std::vector<uint8_t> codes(static_cast<size_t>(t.numel()));
  cpu::fp8_quantize(t.data<float>(), rows, cols, whole, &scale, format, codes.data());
  std::vector<float> back(codes.size());
  cpu::fp8_dequantize(codes.data(), rows, cols, whole, &scale, format, back.data());
  return std::vector<double>(back.begin(), back.end());
}

// out[m, n] = sum_k a(m, k) b(n, k), with a(m, k) = a[m * sa_m + k * sa_k] (likewise b).
inline std::vector<double> reference_gemm(const std::vector<double>& a, int64_t sa_m, int64_t sa_k,
                                          const std::vector<double>& b, int64_t sb_n, int64_t sb_k, int64_t m,
                                          int64_t n, int64_t k) {
  std::vector<double> out(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t p = 0; p < k; ++p)
        s += a[static_cast<size_t>(i * sa_m + p * sa_k)] * b[static_cast<size_t>(j * sb_n + p * sb_k)];
      out[static_cast<size_t>(i * n + j)] = s;
    }
  return out;
}

}  // namespace forge::testing
