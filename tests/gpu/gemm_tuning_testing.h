// A GoogleTest fixture for the GEMM tuning tests (bf16 and FP8): tuning on with a cache in
// a fresh directory named after the test and the process, and every plan (bf16 and FP8)
// forgotten before and after, so no other test's plans or settings leak in or out.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "kernels/cuda/matmul.h"
#include "ops/matmul.h"

namespace forge::gpu_test {

class GemmTuningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    directory_ = (std::filesystem::temp_directory_path() /
                  fmt::format("forge_gpu_{}_{}_{}", info->test_suite_name(), info->name(), ::getpid()))
                     .string();
    std::filesystem::remove_all(directory_);
    cuda::forget_gemm_plans();
    set_gemm_tuning(true, directory_);
  }
  void TearDown() override {
    set_gemm_tuning(false);
    cuda::forget_gemm_plans();
    std::filesystem::remove_all(directory_);
  }

  std::string directory_;
};

}  // namespace forge::gpu_test
