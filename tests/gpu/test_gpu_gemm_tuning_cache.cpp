// Measured GEMM choices kept across runs (NOTE [GEMM tuning cache]) on the GPU: a shape is
// timed once and saved, a later "process" (the plans forgotten) takes the saved choice
// without timing and computes the same bits, and a damaged file or a stored algorithm
// cuBLASLt rejects falls back to timing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "gemm_tuning_testing.h"
#include "gpu_testing.h"
#include "kernels/cuda/matmul.h"
#include "ops/matmul.h"

namespace forge::gpu_test {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

bool bitwise_equal(const Tensor& gpu_a, const Tensor& gpu_b) {
  Tensor a = gpu_a.to(Device::CPU), b = gpu_b.to(Device::CPU);
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// A fresh cache directory and no plans around each test (tests/gpu/gemm_tuning_testing.h).
class GpuGemmTuningCache : public GemmTuningTest {};

// A forward-like GEMM (bf16 out, beta 0) and a weight-gradient-like one (fp32 out
// accumulating, beta 1), shapes no other test uses.
struct TwoGemms {
  Tensor x, w, dy;  // on the GPU
  Tensor acc0;      // the fp32 accumulator's starting values, on the CPU

  explicit TwoGemms(Rng& rng)
      : x(to_gpu(random_bf16_values({384, 896}, rng), DType::BF16)),
        w(to_gpu(random_bf16_values({640, 896}, rng), DType::BF16)),
        dy(to_gpu(random_bf16_values({384, 640}, rng), DType::BF16)),
        acc0(random_f32({640, 896}, rng)) {}

  // y = x w^T and dW = acc0 + dy^T x.
  std::pair<Tensor, Tensor> run() const {
    Tensor y = poisoned_gpu({384, 640}, DType::BF16);
    matmul(y, x, false, w, true);
    Tensor dw = acc0.to(Device::CUDA);
    matmul(dw, dy, true, x, false, 1.0f, 1.0f);
    return {y, dw};
  }
};

TEST_F(GpuGemmTuningCache, LaterRunTakesTheSavedChoiceAndComputesTheSameBits) {
  Rng rng(seed_for_current_test());
  TwoGemms gemms(rng);
  auto [y_tuned, dw_tuned] = gemms.run();
  const GemmTuningStats first = gemm_tuning_stats();
  EXPECT_EQ(first.shapes_tuned, 2);
  EXPECT_EQ(first.shapes_from_cache, 0);
  EXPECT_EQ(first.choices_loaded, 0);
  ASSERT_FALSE(first.cache_file.empty());
  EXPECT_EQ(std::filesystem::path(first.cache_file).parent_path(), std::filesystem::path(directory_));
  ASSERT_TRUE(std::filesystem::exists(first.cache_file)) << "each tuned shape is saved at once";

  cuda::forget_gemm_plans();  // as a new process would start
  ::testing::internal::CaptureStderr();
  auto [y_cached, dw_cached] = gemms.run();
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  const GemmTuningStats second = gemm_tuning_stats();
  EXPECT_EQ(second.cache_file, first.cache_file);
  EXPECT_EQ(second.choices_loaded, 2);
  EXPECT_EQ(second.shapes_from_cache, 2);
  EXPECT_EQ(second.shapes_tuned, 0) << "nothing is timed again";
  EXPECT_EQ(second.cached_rejected, 0);
  EXPECT_TRUE(bitwise_equal(y_cached, y_tuned)) << "bf16, beta 0";
  EXPECT_TRUE(bitwise_equal(dw_cached, dw_tuned)) << "fp32, beta 1";
}

TEST_F(GpuGemmTuningCache, CorruptFileIsIgnoredWithAWarningAndTunedAgain) {
  Rng rng(seed_for_current_test());
  TwoGemms gemms(rng);
  auto [y_tuned, dw_tuned] = gemms.run();
  const std::string path = gemm_tuning_stats().cache_file;
  std::string bytes = read_file(path);
  ASSERT_NE(bytes.find("algo="), std::string::npos) << bytes;
  bytes[bytes.find("algo=") + 30] ^= 0x01;
  write_file(path, bytes);

  cuda::forget_gemm_plans();
  ::testing::internal::CaptureStderr();
  auto [y, dw] = gemms.run();
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warnings.find(path + " is ignored: checksum mismatch"), std::string::npos) << warnings;
  const GemmTuningStats stats = gemm_tuning_stats();
  EXPECT_EQ(stats.choices_loaded, 0);
  EXPECT_EQ(stats.shapes_from_cache, 0);
  EXPECT_EQ(stats.shapes_tuned, 2);
  EXPECT_LT(relative_l2(to_cpu_f32(y), to_cpu_f32(y_tuned)), kBf16Tolerance);
  EXPECT_LT(relative_l2(to_cpu_f32(dw), to_cpu_f32(dw_tuned)), kF32Tolerance);

  cuda::forget_gemm_plans();  // the tuning rewrote a valid file
  gemms.run();
  EXPECT_EQ(gemm_tuning_stats().shapes_from_cache, 2);
}

// The checksum line of the format (NOTE [GEMM tuning cache]): FNV-1a 64 of the bytes above.
std::string with_checksum(const std::string& body) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : body) h = (h ^ c) * 1099511628211ull;
  return body + fmt::format("checksum {:016x}\n", h);
}

TEST_F(GpuGemmTuningCache, StoredAlgorithmThatCublasLtRejectsIsTimedAgain) {
  Rng rng(seed_for_current_test());
  TwoGemms gemms(rng);
  auto [y_tuned, dw_tuned] = gemms.run();
  const std::string path = gemm_tuning_stats().cache_file;
  // A well-formed file whose algorithms are garbage: every word all ones.
  std::string text = read_file(path);
  std::string body = text.substr(0, text.find("checksum "));
  for (size_t at = body.find("algo="); at != std::string::npos; at = body.find("algo=", at + 1))
    body.replace(at + 5, 128, std::string(128, 'f'));
  write_file(path, with_checksum(body));

  cuda::forget_gemm_plans();
  ::testing::internal::CaptureStderr();
  auto [y, dw] = gemms.run();
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warnings.find("cuBLASLt rejects the stored algorithm"), std::string::npos) << warnings;
  const GemmTuningStats stats = gemm_tuning_stats();
  EXPECT_EQ(stats.choices_loaded, 2);
  EXPECT_EQ(stats.cached_rejected, 2);
  EXPECT_EQ(stats.shapes_from_cache, 0);
  EXPECT_EQ(stats.shapes_tuned, 2);
  EXPECT_LT(relative_l2(to_cpu_f32(y), to_cpu_f32(y_tuned)), kBf16Tolerance);
  EXPECT_LT(relative_l2(to_cpu_f32(dw), to_cpu_f32(dw_tuned)), kF32Tolerance);
  EXPECT_EQ(read_file(path).find(std::string(128, 'f')), std::string::npos) << "the new choices replaced them";
}

}  // namespace
}  // namespace forge::gpu_test
