// Preflight's CPU side: verdict bands, the reference table, nccl-tests' bus-bandwidth
// formulas, the driver version parser, and the text and JSON reports of a made-up run.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench/bus_bandwidth.h"
#include "bench/preflight.h"
#include "bench/preflight_reference.h"
#include "bench/preflight_report.h"
#include "config_test_support.h"
#include "core/durable_file.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using config_test::expect_error;

constexpr const char* kH100 = "NVIDIA H100 80GB HBM3";
constexpr const char* kH200 = "NVIDIA H200";

TEST(PreflightBands, PassWarnFailAgainstTheReference) {
  EXPECT_EQ(classify(784, 784.0), Verdict::Pass);
  EXPECT_EQ(classify(900, 784.0), Verdict::Pass);
  EXPECT_EQ(classify(0.90 * 784, 784.0), Verdict::Pass);
  EXPECT_EQ(classify(0.899 * 784, 784.0), Verdict::Warn);
  EXPECT_EQ(classify(0.70 * 784, 784.0), Verdict::Warn);
  EXPECT_EQ(classify(0.699 * 784, 784.0), Verdict::Fail);
  EXPECT_EQ(classify(0, 784.0), Verdict::Fail);
  EXPECT_EQ(classify(std::nan(""), 784.0), Verdict::Fail);
  EXPECT_EQ(classify(123, std::nullopt), Verdict::NoReference);
}

TEST(PreflightReferences, ByExactDeviceNameAndNothingGuessed) {
  EXPECT_EQ(preflight_reference(kH100, PreflightMeasure::Bf16Gemm, 1), 733.0);
  EXPECT_EQ(preflight_reference(kH100, PreflightMeasure::Fp8Gemm, 1), 1220.0);
  EXPECT_EQ(preflight_reference(kH100, PreflightMeasure::DeviceCopy, 1), 3000.0);
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::Bf16Gemm, 1), 685.0);
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::Fp8Gemm, 1), 1214.0);
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::DeviceCopy, 4), 4300.0);
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::AllReduce, 4), 355.0);
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::AllReduce, 8), 359.0);
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::AllGather, 8), 344.0);
  // Measured with 4 and 8 H200s only; other counts, other GPUs and unmeasured checks have none.
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::AllReduce, 2), std::nullopt);
  EXPECT_EQ(preflight_reference(kH100, PreflightMeasure::AllReduce, 4), std::nullopt);
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::AllGather, 4), std::nullopt);
  EXPECT_EQ(preflight_reference(kH200, PreflightMeasure::HostToDevice, 1), std::nullopt);
  EXPECT_EQ(preflight_reference("NVIDIA H100 PCIe", PreflightMeasure::Bf16Gemm, 1), std::nullopt);
  EXPECT_EQ(preflight_reference("NVIDIA H200 NVL", PreflightMeasure::DeviceCopy, 1), std::nullopt);
  EXPECT_EQ(preflight_reference("", PreflightMeasure::AllReduce, 4), std::nullopt);
}

TEST(BusBandwidth, NcclTestsFormulas) {
  const double gib = 1073741824.0;
  EXPECT_DOUBLE_EQ(algorithm_bandwidth(gib, 0.01), gib / 0.01);
  // all-reduce: 2(n-1)/n; all-gather: (n-1)/n.
  EXPECT_DOUBLE_EQ(allreduce_bus_bandwidth(gib, 0.01, 2), gib / 0.01);
  EXPECT_DOUBLE_EQ(allreduce_bus_bandwidth(gib, 0.01, 4), 1.5 * gib / 0.01);
  EXPECT_DOUBLE_EQ(allreduce_bus_bandwidth(gib, 0.01, 8), 1.75 * gib / 0.01);
  EXPECT_DOUBLE_EQ(allgather_bus_bandwidth(gib, 0.01, 2), 0.5 * gib / 0.01);
  EXPECT_DOUBLE_EQ(allgather_bus_bandwidth(gib, 0.01, 4), 0.75 * gib / 0.01);
  EXPECT_DOUBLE_EQ(allgather_bus_bandwidth(gib, 0.01, 8), 0.875 * gib / 0.01);
}

TEST(PreflightDriverVersion, FromProcDriverNvidiaVersion) {
  EXPECT_EQ(parse_nvidia_driver_version(
                "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"),
            "550.54.15");
  EXPECT_EQ(parse_nvidia_driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release "
                                        "Build  (dvs-builder@U16-I3-B16-1-1)  Sun Jul 27 07:09:19 UTC 2025\n"),
            "580.65.06");
  EXPECT_EQ(parse_nvidia_driver_version(""), "");
  EXPECT_EQ(parse_nvidia_driver_version("no version here\nGCC version: 12.2.0\n"), "");
}

PreflightReport sample_report() {
  PreflightReport r;
  r.system = {"node-7", "580.65.06", "13.0", "13.0", "2.28.9"};
  r.gpus = {{0, kH200, int64_t{150} << 30, 9, 0, 1980, 3201, true, "00000000:19:00.0"},
            {1, kH200, int64_t{150} << 30, 9, 0, 1980, 3201, false, "00000000:3B:00.0"}};
  auto check = [](std::string name, int gpu, std::string unit, std::optional<double> value,
                  std::optional<double> expected, std::string detail = "") {
    PreflightCheck c{std::move(name), gpu, std::move(unit), value, expected};
    c.verdict = value ? classify(*value, expected) : Verdict::Fail;
    c.detail = std::move(detail);
    return c;
  };
  r.checks = {check("bf16 GEMM 8192^3", 0, "TFLOP/s", 741.23, 784.0),
              check("bf16 GEMM 8192^3", 1, "TFLOP/s", 600, 784.0),
              check("host-to-device copy 256 MiB, pinned", 0, "GB/s", 52.345, std::nullopt),
              check("NCCL all-reduce bf16 1 GiB, 2 GPUs, bus bandwidth", -1, "GB/s", std::nullopt, std::nullopt,
                    "ncclCommInitAll: unhandled system error")};
  return r;
}

TEST(PreflightReport, TextListsSystemGpusChecksAndTheResult) {
  const std::string text = preflight_text(sample_report());
  EXPECT_NE(text.find("forge preflight on node-7: NVIDIA driver 580.65.06, CUDA driver 13.0, CUDA runtime 13.0, "
                      "NCCL 2.28.9\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("0    NVIDIA H200  150.0 GiB  9.0      1980 MHz      3201 MHz          on   00000000:19:00.0\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("1    NVIDIA H200  150.0 GiB  9.0      1980 MHz      3201 MHz          off  00000000:3B:00.0\n"),
            std::string::npos)
      << text;
  std::istringstream lines(text);
  std::vector<std::string> check_lines;
  for (std::string line; std::getline(lines, line);) {
    if (line.starts_with("bf16") || line.starts_with("host") || line.starts_with("NCCL")) check_lines.push_back(line);
  }
  ASSERT_EQ(check_lines.size(), 4u);
  EXPECT_EQ(check_lines[0],
            "bf16 GEMM 8192^3                                   0    741 TFLOP/s  784 TFLOP/s  95%    pass");
  EXPECT_EQ(check_lines[1],
            "bf16 GEMM 8192^3                                   1    600 TFLOP/s  784 TFLOP/s  77%    warn");
  EXPECT_EQ(check_lines[2],
            "host-to-device copy 256 MiB, pinned                0    52.3 GB/s    -            -      no reference");
  EXPECT_EQ(check_lines[3],
            "NCCL all-reduce bf16 1 GiB, 2 GPUs, bus bandwidth  all  -            -            -      "
            "fail: ncclCommInitAll: unhandled system error");
  EXPECT_NE(text.find("result: fail (1 pass, 1 warn, 1 fail, 1 no reference, 0 skipped; pass >= 90% of the "
                      "reference, warn >= 70%)"),
            std::string::npos)
      << text;
}

TEST(PreflightReport, OverallVerdict) {
  PreflightReport r = sample_report();
  EXPECT_EQ(overall_verdict(r), Verdict::Fail);
  r.checks.pop_back();
  EXPECT_EQ(overall_verdict(r), Verdict::Warn);
  r.checks.erase(r.checks.begin() + 1);
  EXPECT_EQ(overall_verdict(r), Verdict::Pass);
  EXPECT_EQ(overall_verdict(PreflightReport{}), Verdict::Pass);
}

TEST(PreflightReport, JsonHasEveryFieldAndIsWrittenAtomically) {
  TempDir dir;
  const std::string path = dir.file("preflight.json");
  write_preflight_json(path, sample_report());
  EXPECT_FALSE(std::filesystem::exists(temporary_path_for(path, ::getpid())));
  std::ifstream in(path);
  const nlohmann::json json = nlohmann::json::parse(in);
  EXPECT_EQ(json["verdict"], "fail");
  EXPECT_EQ(json["system"]["host"], "node-7");
  EXPECT_EQ(json["system"]["driver_version"], "580.65.06");
  EXPECT_EQ(json["system"]["nccl_version"], "2.28.9");
  ASSERT_EQ(json["gpus"].size(), 2u);
  EXPECT_EQ(json["gpus"][0]["name"], kH200);
  EXPECT_EQ(json["gpus"][0]["memory_bytes"], int64_t{150} << 30);
  EXPECT_EQ(json["gpus"][0]["compute_capability"], "9.0");
  EXPECT_EQ(json["gpus"][0]["max_sm_clock_mhz"], 1980);
  EXPECT_EQ(json["gpus"][0]["max_memory_clock_mhz"], 3201);
  EXPECT_EQ(json["gpus"][1]["ecc_enabled"], false);
  EXPECT_EQ(json["gpus"][1]["pci_bus_id"], "00000000:3B:00.0");
  ASSERT_EQ(json["checks"].size(), 4u);
  const nlohmann::json& gemm = json["checks"][0];
  EXPECT_EQ(gemm["check"], "bf16 GEMM 8192^3");
  EXPECT_EQ(gemm["gpu"], 0);
  EXPECT_EQ(gemm["unit"], "TFLOP/s");
  EXPECT_DOUBLE_EQ(gemm["value"].get<double>(), 741.23);
  EXPECT_DOUBLE_EQ(gemm["expected"].get<double>(), 784.0);
  EXPECT_DOUBLE_EQ(gemm["ratio"].get<double>(), 741.23 / 784.0);
  EXPECT_EQ(gemm["verdict"], "pass");
  EXPECT_TRUE(json["checks"][2]["expected"].is_null());
  EXPECT_TRUE(json["checks"][2]["ratio"].is_null());
  EXPECT_EQ(json["checks"][2]["verdict"], "no reference");
  const nlohmann::json& nccl = json["checks"][3];
  EXPECT_TRUE(nccl["gpu"].is_null());
  EXPECT_TRUE(nccl["value"].is_null());
  EXPECT_EQ(nccl["verdict"], "fail");
  EXPECT_EQ(nccl["detail"], "ncclCommInitAll: unhandled system error");
}

#ifndef FORGE_CUDA
TEST(Preflight, BuildWithoutCudaSaysSo) {
  expect_error([] { run_preflight_checks(); }, {"forge preflight", "no CUDA backend", "-DFORGE_CUDA=ON"});
}
#endif

}  // namespace
}  // namespace forge
