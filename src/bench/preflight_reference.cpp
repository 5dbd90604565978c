// The reference table and the verdict rule; see preflight_reference.h.
//
// NOTE [Preflight references]
// Every reference was measured on the device machine, never taken from a data sheet: a
// data-sheet peak is never reached, and a check against it would warn on every healthy GPU.
// The GEMM references are forge preflight's own measurements (docs/PERF.md, "System
// validation", 2026-11-22), with the inputs this check uses: GEMM throughput depends on the
// data (power draw), and the earlier references, PyTorch's 784 / 1436 TFLOP/s from
// ../shared/PERF.md's "Ceilings" on other inputs, put healthy GPUs at 85-87% (warn).
//   bf16 GEMM 8192^3   733 TFLOP/s H100 80GB HBM3 (one run), 685 H200 (median of four GPUs
//                      in two runs: 687, 683, 672, 686)
//   fp8 GEMM 8192^3   1220 TFLOP/s H100 (one run), 1214 H200 (1187 and 1241)
//   device copy       3000 GB/s H100, 4300 GB/s H200 (bytes read + bytes written;
//                     ../shared/PERF.md; preflight measured 3011 and 4224-4229)
//   all-reduce         355 GB/s bus bandwidth, bf16, 1 GiB, 4 x H200 over NVLink; 359 on
//                      8 x H200 (forge preflight, nvidia-h200-x8, one run)
//   all-gather         344 GB/s bus bandwidth, bf16, 1 GiB, 8 x H200 (the same run)
// Devices are matched by their exact CUDA name: "NVIDIA H100 80GB HBM3" is the SXM part;
// the PCIe and NVL variants (lower power and clocks) and every other GPU get no
// reference, and their checks report "no reference" instead of a guess. Host-to-device
// bandwidth depends on the host's PCIe link rather than the GPU, and the collectives at
// GPU counts not listed were not measured: no reference either, until someone measures them.
//
// The bands: >= 90% of the reference passes (run-to-run spread on a healthy GPU is a few
// percent); >= 70% warns (a hot or power-capped GPU, a neighbour's job); below 70%
// something is wrong (a throttled or broken GPU, PCIe fallback of NVLink traffic, a
// missing library fast path).
#include "bench/preflight_reference.h"

#include <array>

namespace forge {
namespace {

struct DeviceReference {
  const char* device_name;
  double bf16_gemm_tflops;
  double fp8_gemm_tflops;
  double device_copy_gbps;
};

constexpr std::array<DeviceReference, 2> kReferences = {{
    {"NVIDIA H100 80GB HBM3", 733, 1220, 3000},
    {"NVIDIA H200", 685, 1214, 4300},
}};

// A collective's bus bandwidth, for the GPU count it was measured with.
struct CollectiveReference {
  const char* device_name;
  PreflightMeasure measure;
  int gpus;
  double gbps;
};

constexpr std::array<CollectiveReference, 3> kCollectiveReferences = {{
    {"NVIDIA H200", PreflightMeasure::AllReduce, 4, 355},
    {"NVIDIA H200", PreflightMeasure::AllReduce, 8, 359},
    {"NVIDIA H200", PreflightMeasure::AllGather, 8, 344},
}};

}  // namespace

std::optional<double> preflight_reference(const std::string& device_name, PreflightMeasure measure, int n_gpus) {
  if (measure == PreflightMeasure::AllReduce || measure == PreflightMeasure::AllGather) {
    for (const CollectiveReference& r : kCollectiveReferences)
      if (device_name == r.device_name && measure == r.measure && n_gpus == r.gpus) return r.gbps;
    return std::nullopt;
  }
  for (const DeviceReference& r : kReferences) {
    if (device_name != r.device_name) continue;
    switch (measure) {
      case PreflightMeasure::Bf16Gemm: return r.bf16_gemm_tflops;
      case PreflightMeasure::Fp8Gemm: return r.fp8_gemm_tflops;
      case PreflightMeasure::DeviceCopy: return r.device_copy_gbps;
      case PreflightMeasure::AllReduce:
      case PreflightMeasure::AllGather:
      case PreflightMeasure::HostToDevice: return std::nullopt;
    }
  }
  return std::nullopt;
}

Verdict classify(double value, std::optional<double> expected) {
  if (!expected) return Verdict::NoReference;
  if (value >= kPassFraction * *expected) return Verdict::Pass;
  if (value >= kWarnFraction * *expected) return Verdict::Warn;
  return Verdict::Fail;
}

}  // namespace forge
