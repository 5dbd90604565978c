// forge preflight: system validation before training, as the seeds' users run before
// benchmarking (their "System validation" step), for NVIDIA GPUs. It lists the GPUs and
// the software stack, measures what training leans on — per GPU: bf16 and fp8 GEMM
// throughput, HBM copy bandwidth, host-to-device bandwidth; across the GPUs: NCCL
// all-reduce and all-gather bus bandwidth — and compares each number with what the same
// GPU model reaches when healthy (preflight_reference.h). A GPU that is throttled, a
// mis-seated NVLink, a wrong driver or a library falling back to a slow path shows up as
// a failed check before hours of training are spent on it.
//
// The measurements call CUDA libraries and live in bench/cuda/ (preflight_measure.h);
// everything else here builds and is tested on the CPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace forge {

enum class Verdict {
  Pass,         // at least kPassFraction of the reference
  Warn,         // at least kWarnFraction of it
  Fail,         // below that, or the measurement itself failed
  NoReference,  // measured, but forge knows no healthy figure for this GPU model
  Skipped,      // not measurable on this GPU (fp8 before compute capability 8.9)
};

const char* verdict_name(Verdict verdict);  // "pass", "warn", "fail", "no reference", "skipped"

struct GpuInfo {
  int index = 0;
  std::string name;            // "NVIDIA H100 80GB HBM3"
  int64_t memory_bytes = 0;
  int compute_major = 0, compute_minor = 0;
  int max_sm_clock_mhz = 0;    // peak SM clock (cudaDevAttrClockRate)
  int max_memory_clock_mhz = 0;  // peak memory clock (cudaDevAttrMemoryClockRate)
  bool ecc_enabled = false;
  std::string pci_bus_id;      // "0000:19:00.0"
};

struct SystemInfo {
  std::string host;
  std::string driver_version;        // the kernel module's, from /proc/driver/nvidia/version; "" if unreadable
  std::string cuda_driver_version;   // the CUDA version the driver supports, "13.0"
  std::string cuda_runtime_version;  // the CUDA runtime forge was built with, "13.0"
  std::string nccl_version;          // "2.28.9"
};

struct PreflightCheck {
  std::string name;                 // "bf16 GEMM 8192^3"
  int gpu = -1;                     // the GPU's index, or -1 for a check across all GPUs
  std::string unit;                 // "TFLOP/s", "GB/s"
  std::optional<double> value;      // empty when the measurement failed or was skipped
  std::optional<double> expected;   // the healthy figure for this GPU model, when known
  Verdict verdict = Verdict::NoReference;
  std::string detail;               // why it failed or was skipped
};

struct PreflightReport {
  SystemInfo system;
  std::vector<GpuInfo> gpus;
  std::vector<PreflightCheck> checks;
};

// Fail when any check failed, else Warn when any warned, else Pass.
Verdict overall_verdict(const PreflightReport& report);

// The driver version in the text of /proc/driver/nvidia/version: the first
// dotted-number word of its first line ("550.54.15"); "" when there is none.
std::string parse_nvidia_driver_version(const std::string& proc_text);

// Inventories the GPUs and runs every check; under two minutes on an 8-GPU node. Throws
// forge::Error when this build has no CUDA backend or no GPU is visible; a check that
// cannot run is recorded as failed, with the error in its detail.
PreflightReport run_preflight_checks();

}  // namespace forge
