// forge preflight's measurements on the real device: each returns a positive, finite
// number on GPU 0 (how good the number is, is preflight's own verdict, not this test's);
// forge's matmul runs on every GPU of one process; the collectives run when there are
// two GPUs or more; and the whole preflight finishes within its two minutes.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "bench/preflight.h"
#include "bench/preflight_measure.h"
#include "bench/preflight_report.h"

namespace forge {
namespace {

void expect_positive_finite(double value, const char* what) {
  EXPECT_TRUE(std::isfinite(value)) << what << ": " << value;
  EXPECT_GT(value, 0) << what;
}

TEST(GpuPreflight, InventoryOfGpu0) {
  ASSERT_GE(visible_gpu_count(), 1);
  const GpuInfo g = query_gpu(0);
  EXPECT_FALSE(g.name.empty());
  EXPECT_GT(g.memory_bytes, int64_t{1} << 30);
  EXPECT_GE(g.compute_major, 7);
  EXPECT_GT(g.max_sm_clock_mhz, 0);
  EXPECT_GT(g.max_memory_clock_mhz, 0);
  EXPECT_FALSE(g.pci_bus_id.empty());
  const SystemInfo s = query_cuda_versions();
  EXPECT_FALSE(s.cuda_driver_version.empty());
  EXPECT_FALSE(s.cuda_runtime_version.empty());
  EXPECT_FALSE(s.nccl_version.empty());
}

TEST(GpuPreflight, MeasurementsOnGpu0ArePositiveAndFinite) {
  const GpuInfo g = query_gpu(0);
  const double bf16 = measure_bf16_gemm_tflops(0, 8192);
  expect_positive_finite(bf16, "bf16 GEMM TFLOP/s");
  if (g.compute_major * 10 + g.compute_minor >= 89) {
    expect_positive_finite(measure_fp8_gemm_tflops(0, 8192), "fp8 GEMM TFLOP/s");
  }
  expect_positive_finite(measure_device_copy_gbps(0, size_t{256} << 20), "device copy GB/s");
  expect_positive_finite(measure_host_to_device_gbps(0, size_t{64} << 20), "host-to-device GB/s");
  std::printf("%s: bf16 GEMM %.0f TFLOP/s\n", g.name.c_str(), bf16);
}

TEST(GpuPreflight, Bf16GemmOnEveryGpuOfOneProcess) {
  for (int gpu = 0; gpu < visible_gpu_count(); ++gpu) {
    expect_positive_finite(measure_bf16_gemm_tflops(gpu, 2048), "bf16 GEMM TFLOP/s");
  }
}

TEST(GpuPreflight, CollectivesAcrossAllGpus) {
  const int n = visible_gpu_count();
  if (n < 2) GTEST_SKIP() << "one GPU: no collectives";
  const CollectiveBandwidth b = measure_nccl_bus_bandwidth(n, size_t{64} << 20);
  expect_positive_finite(b.allreduce_bus_gbps, "all-reduce bus GB/s");
  expect_positive_finite(b.allgather_bus_gbps, "all-gather bus GB/s");
}

TEST(GpuPreflight, WholeRunWithinTwoMinutes) {
  const auto start = std::chrono::steady_clock::now();
  const PreflightReport report = run_preflight_checks();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s", preflight_text(report).c_str());
  std::printf("preflight took %.1f s\n", seconds);
  EXPECT_LT(seconds, 120);
  EXPECT_EQ(report.gpus.size(), static_cast<size_t>(visible_gpu_count()));
  for (const PreflightCheck& c : report.checks) {
    if (c.verdict == Verdict::Skipped) continue;
    ASSERT_TRUE(c.value.has_value()) << c.name << ": " << c.detail;
    expect_positive_finite(*c.value, c.name.c_str());
  }
}

}  // namespace
}  // namespace forge
