// What a healthy GPU of a given model measures in each preflight check, and the verdict a
// measurement earns against it. The figures and their sources are NOTE [Preflight
// references] in preflight_reference.cpp.
#pragma once

#include <optional>
#include <string>

#include "bench/preflight.h"

namespace forge {

enum class PreflightMeasure {
  Bf16Gemm,      // TFLOP/s, 8192^3 through ops/matmul.h
  Fp8Gemm,       // TFLOP/s, 8192^3 e4m3 through cuBLASLt
  DeviceCopy,    // GB/s of HBM traffic (read + write) of a device-to-device copy
  HostToDevice,  // GB/s from pinned host memory
  AllReduce,     // GB/s bus bandwidth, bf16, across all local GPUs
  AllGather,     // GB/s bus bandwidth, bf16, across all local GPUs
};

// A measurement passes from this fraction of its reference, warns from kWarnFraction.
constexpr double kPassFraction = 0.90;
constexpr double kWarnFraction = 0.70;

// The healthy figure for `device_name` (exactly as CUDA names the device) with `n_gpus`
// GPUs taking part (collectives only); nullopt when forge knows none.
std::optional<double> preflight_reference(const std::string& device_name, PreflightMeasure measure, int n_gpus);

// Pass / Warn / Fail by the fractions above; NoReference without a reference.
Verdict classify(double value, std::optional<double> expected);

}  // namespace forge
