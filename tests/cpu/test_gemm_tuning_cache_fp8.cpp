// The GEMM tuning cache's FP8 entries and its format versions (NOTE [GEMM tuning cache]):
// an FP8 choice is found again only for the same formats, scale modes, accumulation,
// output, beta and shape; a format-1 file (before FP8 entries) is taken over, left as it
// is; a malformed FP8 line is named by its line in the warning naming the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "file_testing.h"
#include "kernels/gemm_tuning_cache.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using cpu::Fp8Format;
using testing::read_file;
using testing::write_file;

const GemmTuningTarget kH100{"NVIDIA H100 80GB HBM3", 132, 130100};
constexpr int64_t kCompute = 68;
constexpr uint64_t kWorkspace = 32u << 20;

GemmProblem bf16_problem(int64_t m, int64_t n, int64_t k) {
  return GemmProblem{m, n, k, false, true, DType::BF16, DType::BF16, true, kCompute, kWorkspace};
}

// A forward-like FP8 GEMM: E4M3 x E4M3, per tensor (cuBLASLt's scale mode 0), fast
// accumulation, bf16 out, beta 0.
GemmProblem fp8_problem(int64_t m, int64_t n, int64_t k) {
  GemmProblem p{m, n, k, false, true, DType::U8, DType::BF16, true, kCompute, kWorkspace};
  p.fp8 = GemmFp8Inputs{Fp8Format::E4M3, Fp8Format::E4M3, 0, 0, true};
  return p;
}

GemmAlgorithm algorithm(uint64_t seed) {
  GemmAlgorithm a{};
  for (size_t i = 0; i < a.size(); ++i) a[i] = seed * 0x9e3779b97f4a7c15ull + i;
  return a;
}

std::string with_checksum(const std::string& body) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : body) h = (h ^ c) * 1099511628211ull;
  return body + fmt::format("checksum {:016x}\n", h);
}

std::string algorithm_hex(const GemmAlgorithm& a) {
  std::string hex;
  for (uint64_t word : a) hex += fmt::format("{:016x}", word);
  return hex;
}

// A format-1 file as forge wrote it before FP8 entries: header, gemm lines, checksum.
std::string format_one_file(const std::vector<std::string>& entries) {
  std::string body = "forge gemm tuning 1\ndevice NVIDIA H100 80GB HBM3\nmultiprocessors 132\ncublaslt 130100\n";
  for (const std::string& entry : entries) body += entry + "\n";
  return with_checksum(body);
}

const std::string kFormatOneEntry = "gemm m=4096 n=14336 k=4096 a=N b=T in=bf16 out=bf16 beta=zero compute=68 "
                                    "workspace=33554432 algo=" + algorithm_hex(algorithm(5));

std::pair<GemmTuningCache, std::string> open_capturing(const std::string& directory) {
  ::testing::internal::CaptureStderr();
  GemmTuningCache cache(directory, kH100);
  return {std::move(cache), ::testing::internal::GetCapturedStderr()};
}

TEST(GemmTuningCacheFp8, ChoicesRoundTripThroughTheFile) {
  GemmChoices choices;
  choices[bf16_problem(8, 8, 8)] = algorithm(1);
  choices[fp8_problem(4096, 14336, 4096)] = algorithm(2);
  GemmProblem backward = fp8_problem(4096, 4096, 14336);  // weight gradient: fp32 out accumulating
  backward.out_dtype = DType::F32;
  backward.beta_zero = false;
  backward.fp8 = GemmFp8Inputs{Fp8Format::E5M2, Fp8Format::E4M3, 2, 3, false};
  choices[backward] = GemmAlgorithm{0, ~0ull, 1, 2, 3, 4, 5, 0x8000000000000000ull};
  const std::string text = serialize_gemm_choices(kH100, choices);
  EXPECT_NE(text.find("\nfp8gemm m=4096 n=4096 k=14336 a=N b=T in=e5m2,e4m3 scale=2,3 accumulate=full out=f32 "
                      "beta=nonzero compute=68 workspace=33554432 algo=0000000000000000ffffffffffffffff"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("\nfp8gemm m=4096 n=14336 k=4096 a=N b=T in=e4m3,e4m3 scale=0,0 accumulate=fast out=bf16 "
                      "beta=zero "),
            std::string::npos)
      << text;
  ParsedGemmChoices parsed = parse_gemm_choices(text, kH100);
  EXPECT_EQ(parsed.error, "");
  EXPECT_EQ(parsed.choices, choices);

  TempDir dir;
  {
    GemmTuningCache cache(dir.file("cache"), kH100);
    for (const auto& [problem, algo] : choices) cache.add(problem, algo);
  }
  auto [reloaded, warnings] = open_capturing(dir.file("cache"));
  EXPECT_EQ(warnings, "");
  EXPECT_EQ(reloaded.loaded(), 3u);
  for (const auto& [problem, algo] : choices) EXPECT_EQ(reloaded.find(problem), algo);
}

TEST(GemmTuningCacheFp8, EveryPartOfAnFp8ProblemIsPartOfTheKey) {
  TempDir dir;
  GemmTuningCache cache(dir.file("cache"), kH100);
  const GemmProblem saved = fp8_problem(512, 384, 1024);
  cache.add(saved, algorithm(7));
  GemmTuningCache reloaded(dir.file("cache"), kH100);
  ASSERT_EQ(reloaded.find(saved), algorithm(7));

  std::vector<GemmProblem> others(11, saved);
  others[0].fp8->a_format = Fp8Format::E5M2;
  others[1].fp8->b_format = Fp8Format::E5M2;
  others[2].fp8->a_scale_mode = 1;
  others[3].fp8->b_scale_mode = 1;
  others[4].fp8->fast_accumulation = false;
  others[5].out_dtype = DType::F32;
  others[6].beta_zero = false;
  others[7].m = 513;
  others[8].n = 385;
  others[9].k = 1040;
  others[10].fp8.reset();  // a bf16 GEMM of the same shape
  others[10].input_dtype = DType::BF16;
  for (size_t i = 0; i < others.size(); ++i) EXPECT_FALSE(reloaded.find(others[i])) << "variant " << i;
}

TEST(GemmTuningCacheFp8, FormatOneFileIsTakenOverAndLeftAsItIs) {
  TempDir dir;
  const std::string directory = dir.file("cache");
  std::filesystem::create_directories(directory);
  const std::string v1_path = directory + "/" + gemm_tuning_file_name(kH100, 1);
  const std::string v1_bytes = format_one_file({kFormatOneEntry});
  write_file(v1_path, v1_bytes);

  auto [cache, warnings] = open_capturing(directory);
  EXPECT_EQ(warnings, "");
  EXPECT_EQ(cache.path(), directory + "/" + gemm_tuning_file_name(kH100));
  EXPECT_EQ(cache.loaded(), 1u);
  EXPECT_EQ(cache.find(bf16_problem(4096, 14336, 4096)), algorithm(5));

  cache.add(fp8_problem(4096, 14336, 4096), algorithm(6));
  EXPECT_EQ(read_file(v1_path), v1_bytes) << "the format-1 file stays for forge builds that read only it";
  GemmTuningCache next_run(directory, kH100);
  EXPECT_EQ(next_run.loaded(), 2u) << "the format-2 file holds the taken-over choice and the new one";
  EXPECT_EQ(next_run.find(bf16_problem(4096, 14336, 4096)), algorithm(5));
  EXPECT_EQ(next_run.find(fp8_problem(4096, 14336, 4096)), algorithm(6));

  // Once a format-2 file exists, the format-1 file is not read again.
  write_file(v1_path, format_one_file({}));
  EXPECT_EQ(GemmTuningCache(directory, kH100).loaded(), 2u);
}

TEST(GemmTuningCacheFp8, FormatOneHasNoFp8Lines) {
  const std::string fp8_line = "fp8gemm m=16 n=16 k=16 a=N b=T in=e4m3,e4m3 scale=0,0 accumulate=fast out=bf16 "
                               "beta=zero compute=68 workspace=33554432 algo=" + algorithm_hex(algorithm(1));
  const std::string v1 = format_one_file({kFormatOneEntry, fp8_line});
  EXPECT_EQ(parse_gemm_choices(v1, kH100).error, "line 6 is not a GEMM choice of format 1");

  TempDir dir;
  const std::string directory = dir.file("cache");
  std::filesystem::create_directories(directory);
  const std::string v1_path = directory + "/" + gemm_tuning_file_name(kH100, 1);
  write_file(v1_path, v1);
  auto [cache, warnings] = open_capturing(directory);
  EXPECT_EQ(cache.loaded(), 0u);
  EXPECT_NE(warnings.find("GEMM tuning cache " + v1_path + " (format 1) is not taken over into " + cache.path() +
                          ": line 6 is not a GEMM choice of format 1"),
            std::string::npos)
      << warnings;
  cache.add(fp8_problem(16, 16, 16), algorithm(2));
  EXPECT_EQ(read_file(v1_path), v1) << "a format-1 file is never written";
}

// Each damage keeps the line's checksum valid: only the fp8gemm line (line 6) is wrong.
TEST(GemmTuningCacheFp8, MalformedFp8LineIsNamedWithTheFile) {
  GemmChoices choices{{bf16_problem(8, 8, 8), algorithm(1)}, {fp8_problem(16, 32, 64), algorithm(2)}};
  const std::string valid = serialize_gemm_choices(kH100, choices);
  const std::string body = valid.substr(0, valid.find("checksum "));
  ASSERT_EQ(body.find("fp8gemm"), body.find("\n", body.find("gemm m=8")) + 1) << "the fp8 line is line 6\n" << body;
  const std::pair<std::string, std::string> damages[] = {
      {"in=e4m3,e4m3", "in=e4m3,e6m2"},      {"in=e4m3,e4m3", "in=e4m3"},
      {"in=e4m3,e4m3", "in=bf16"},           {"scale=0,0", "scale=0,-1"},
      {"scale=0,0", "scale=0,x"},            {"scale=0,0", "scale=0,0,0"},
      {"accumulate=fast", "accumulate=half"}, {" accumulate=fast", ""},
      {"scale=0,0 accumulate=fast", "accumulate=fast scale=0,0"}, {"fp8gemm m=16", "fp8gemm m=0"},
      {"fp8gemm", "fp9gemm"},
  };
  for (const auto& [from, to] : damages) {
    SCOPED_TRACE(to);
    std::string damaged = body;
    const size_t at = damaged.find(from, damaged.find("fp8gemm"));
    ASSERT_NE(at, std::string::npos);
    damaged.replace(at, from.size(), to);
    EXPECT_EQ(parse_gemm_choices(with_checksum(damaged), kH100).error, "line 6 is not a GEMM choice of format 2");

    TempDir dir;
    const std::string directory = dir.file("cache");
    std::filesystem::create_directories(directory);
    const std::string path = directory + "/" + gemm_tuning_file_name(kH100);
    write_file(path, with_checksum(damaged));
    auto [cache, warnings] = open_capturing(directory);
    EXPECT_EQ(cache.loaded(), 0u);
    EXPECT_NE(warnings.find(path + " is ignored: line 6 is not a GEMM choice of format 2"), std::string::npos)
        << warnings;
  }
}

}  // namespace
}  // namespace forge
