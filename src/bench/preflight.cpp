// run_preflight_checks: the order of the checks, their sizes, and how each becomes a verdict.
// The sizes are the ones PERF.md's ceilings were measured at (GEMMs 8192^3, collectives
// 1 GiB), so the references apply; the copies use buffers large enough that launch
// overhead is invisible (1 GiB within the GPU, 256 MiB from the host).
#include "bench/preflight.h"

#include <unistd.h>

#include <climits>
#include <cmath>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>

#include <fmt/format.h>

#include "bench/preflight_reference.h"
#include "core/error.h"
#ifdef FORGE_CUDA
#include "bench/preflight_measure.h"
#endif

namespace forge {
namespace {

#ifdef FORGE_CUDA
constexpr int64_t kGemmSize = 8192;
constexpr size_t kDeviceCopyBytes = size_t{1} << 30;
constexpr size_t kHostCopyBytes = size_t{256} << 20;
constexpr size_t kCollectiveBytes = size_t{1} << 30;

std::string host_name() {
  char host[HOST_NAME_MAX + 1] = {};
  return ::gethostname(host, sizeof(host) - 1) == 0 ? host : "";
}

std::string kernel_driver_version() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::stringstream text;
  text << in.rdbuf();
  return parse_nvidia_driver_version(text.str());
}

// A measurement's outcome: its value, or why there is none.
struct Attempt {
  std::optional<double> value;
  std::string error;
};

Attempt attempt(const std::function<double()>& measure) {
  try {
    return {measure(), ""};
  } catch (const std::exception& e) {
    return {std::nullopt, e.what()};
  }
}

// An error, or a value that is not a finite number, fails the check instead of the run.
PreflightCheck make_check(std::string name, int gpu, std::string unit, std::optional<double> expected,
                          const Attempt& outcome) {
  PreflightCheck check{std::move(name), gpu, std::move(unit), outcome.value, expected, Verdict::NoReference, ""};
  if (!outcome.value) {
    check.verdict = Verdict::Fail;
    check.detail = outcome.error;
  } else if (!std::isfinite(*outcome.value)) {
    check.value.reset();
    check.verdict = Verdict::Fail;
    check.detail = "the measurement is not a finite number";
  } else {
    check.verdict = classify(*outcome.value, expected);
  }
  return check;
}
#endif

}  // namespace

const char* verdict_name(Verdict verdict) {
  switch (verdict) {
    case Verdict::Pass: return "pass";
    case Verdict::Warn: return "warn";
    case Verdict::Fail: return "fail";
    case Verdict::NoReference: return "no reference";
    case Verdict::Skipped: return "skipped";
  }
  return "";
}

Verdict overall_verdict(const PreflightReport& report) {
  Verdict overall = Verdict::Pass;
  for (const PreflightCheck& check : report.checks) {
    if (check.verdict == Verdict::Fail) return Verdict::Fail;
    if (check.verdict == Verdict::Warn) overall = Verdict::Warn;
  }
  return overall;
}

std::string parse_nvidia_driver_version(const std::string& proc_text) {
  std::istringstream words(proc_text.substr(0, proc_text.find('\n')));
  static const std::regex version(R"(\d+(\.\d+)+)");
  for (std::string word; words >> word;) {
    if (std::regex_match(word, version)) return word;
  }
  return "";
}

PreflightReport run_preflight_checks() {
#ifndef FORGE_CUDA
  FORGE_FAIL("forge preflight: this build of forge has no CUDA backend (configure with -DFORGE_CUDA=ON)");
#else
  PreflightReport report;
  report.system = query_cuda_versions();
  report.system.host = host_name();
  report.system.driver_version = kernel_driver_version();
  const int n = visible_gpu_count();
  if (n == 0) FORGE_FAIL("forge preflight: no NVIDIA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)");
  for (int gpu = 0; gpu < n; ++gpu) report.gpus.push_back(query_gpu(gpu));

  const std::string gemm = fmt::format("{}^3", kGemmSize);
  for (const GpuInfo& g : report.gpus) {
    auto reference = [&](PreflightMeasure measure) { return preflight_reference(g.name, measure, n); };
    report.checks.push_back(make_check("bf16 GEMM " + gemm, g.index, "TFLOP/s", reference(PreflightMeasure::Bf16Gemm),
                                       attempt([&] { return measure_bf16_gemm_tflops(g.index, kGemmSize); })));
    if (g.compute_major * 10 + g.compute_minor >= 89) {
      std::string unsupported;
      const Attempt fp8 = attempt([&]() -> double {
        try {
          return measure_fp8_gemm_tflops(g.index, kGemmSize);
        } catch (const Fp8GemmUnsupported& e) {
          unsupported = e.what();
          throw;
        }
      });
      if (unsupported.empty()) {
        report.checks.push_back(
            make_check("fp8 e4m3 GEMM " + gemm, g.index, "TFLOP/s", reference(PreflightMeasure::Fp8Gemm), fp8));
      } else {
        report.checks.push_back({"fp8 e4m3 GEMM " + gemm, g.index, "TFLOP/s", std::nullopt, std::nullopt,
                                 Verdict::Skipped, unsupported});
      }
    } else {
      report.checks.push_back({"fp8 e4m3 GEMM " + gemm, g.index, "TFLOP/s", std::nullopt, std::nullopt,
                               Verdict::Skipped,
                               fmt::format("fp8 tensor cores need compute capability 8.9+, this GPU has {}.{}",
                                           g.compute_major, g.compute_minor)});
    }
    report.checks.push_back(make_check("device-to-device copy 1 GiB", g.index, "GB/s",
                                       reference(PreflightMeasure::DeviceCopy),
                                       attempt([&] { return measure_device_copy_gbps(g.index, kDeviceCopyBytes); })));
    report.checks.push_back(make_check(
        "host-to-device copy 256 MiB, pinned", g.index, "GB/s", reference(PreflightMeasure::HostToDevice),
        attempt([&] { return measure_host_to_device_gbps(g.index, kHostCopyBytes); })));
  }

  if (n >= 2) {
    // Collectives have a reference only on a node of one GPU model.
    std::string model = report.gpus.front().name;
    for (const GpuInfo& g : report.gpus) {
      if (g.name != model) model.clear();
    }
    std::optional<CollectiveBandwidth> bandwidth;
    const Attempt allreduce = attempt([&] {
      bandwidth = measure_nccl_bus_bandwidth(n, kCollectiveBytes);
      return bandwidth->allreduce_bus_gbps;
    });
    const Attempt allgather = bandwidth ? Attempt{bandwidth->allgather_bus_gbps, ""} : allreduce;
    report.checks.push_back(make_check(fmt::format("NCCL all-reduce bf16 1 GiB, {} GPUs, bus bandwidth", n), -1,
                                       "GB/s", preflight_reference(model, PreflightMeasure::AllReduce, n),
                                       allreduce));
    report.checks.push_back(make_check(fmt::format("NCCL all-gather bf16 1 GiB, {} GPUs, bus bandwidth", n), -1,
                                       "GB/s", preflight_reference(model, PreflightMeasure::AllGather, n),
                                       allgather));
  }
  return report;
#endif
}

}  // namespace forge
