// The two FP8 formats of Hopper's tensor cores, on the host: conversion from fp32 with
// round-to-nearest-even, plain (as PyTorch's cast) or saturating (as scaled FP8 training
// casts), and back to fp32. The CPU reference the CUDA casts and the tests are held to.
//
// NOTE [FP8 formats]
//   E4M3 ("fn": finite, NaN only): 1 sign, 4 exponent (bias 7), 3 mantissa bits. Largest
//     finite 448 (0x7e), smallest subnormal 2^-9; 0x7f / 0xff are NaN; no infinity.
//   E5M2 (IEEE-like): 1 sign, 5 exponent (bias 15), 2 mantissa bits. Largest finite 57344
//     (0x7b), smallest subnormal 2^-16; 0x7c / 0xfc are +-inf, 0x7d..0x7f NaN.
// Both casts round to nearest, ties to even, on the format's grid (subnormals included),
// keep the sign (of zeros and NaNs too) and map any NaN to 0x7f | sign.
//  - fp8_from_float (plain): bitwise torch.Tensor.to(torch.float8_e4m3fn / float8_e5m2) on
//    PyTorch <= 2.11 (tests/python/test_fp8_vs_torch.py). A value that rounds past the
//    largest finite becomes NaN in E4M3 (it has no infinity: 464 <= |x| rounds to 448,
//    anything from just above 464 on is NaN) and inf in E5M2 (from 61440 on); +-inf is NaN
//    in E4M3 and +-inf in E5M2.
//  - fp8_from_float_saturated: values beyond the largest finite, infinities included,
//    become +-max; NaN stays NaN. This is torchao's to_fp8_saturated (x.clamp(-max, max)
//    then the plain cast, torchao/float8/float8_utils.py), Transformer Engine's casts, and
//    the PTX cvt.rn.satfinite the GPU kernels use. FP8 training must saturate: a scale
//    computed from a slightly stale amax (delayed scaling) would otherwise turn the
//    largest values of a tensor into NaN.
// (torchao's comment says PyTorch 2.12's eager cast saturates too; the plain cast here is
// the one of the PyTorch in .venv, and the tests compare with it.)
#pragma once

#include <cstdint>

namespace forge::cpu {

enum class Fp8Format : uint8_t { E4M3, E5M2 };

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;

constexpr float fp8_max(Fp8Format format) { return format == Fp8Format::E4M3 ? kFp8E4M3Max : kFp8E5M2Max; }
constexpr const char* fp8_format_name(Fp8Format format) { return format == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }

uint8_t fp8_from_float(float x, Fp8Format format);
uint8_t fp8_from_float_saturated(float x, Fp8Format format);
float fp8_to_float(uint8_t code, Fp8Format format);

// The same over arrays: out[i] = cast(x[i]).
void fp8_from_float(const float* x, int64_t n, Fp8Format format, bool saturate, uint8_t* out);
void fp8_to_float(const uint8_t* codes, int64_t n, Fp8Format format, float* out);

}  // namespace forge::cpu
