// The GEMM tuning cache (NOTE [GEMM tuning cache]): what is saved is found again, only for
// the same problem and the same GPU and library; damaged files are ignored with one
// warning and rewritten; writers merge; the directory follows the environment.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "config_test_support.h"
#include "kernels/gemm_tuning_cache.h"
#include "test_data_temp_dir.h"
#include "file_testing.h"

namespace forge {
namespace {

using config_test::ScopedEnv;

const GemmTuningTarget kH100{"NVIDIA H100 80GB HBM3", 132, 130100};

GemmProblem problem(int64_t m, int64_t n, int64_t k) {
  return GemmProblem{m, n, k, false, true, DType::BF16, DType::BF16, true, 68, 32u << 20};
}

GemmAlgorithm algorithm(uint64_t seed) {
  GemmAlgorithm a{};
  for (size_t i = 0; i < a.size(); ++i) a[i] = seed * 0x9e3779b97f4a7c15ull + i;
  return a;
}

using testing::read_file;
using testing::write_file;

// The checksum line the format documents: FNV-1a 64 of every byte before it.
std::string with_checksum(const std::string& body) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : body) h = (h ^ c) * 1099511628211ull;
  return body + fmt::format("checksum {:016x}\n", h);
}


size_t count_warnings(const std::string& stderr_text) {
  size_t count = 0;
  for (size_t at = stderr_text.find("warning: "); at != std::string::npos; at = stderr_text.find("warning: ", at + 1))
    ++count;
  return count;
}

// Opens a cache, returning it with what it wrote to stderr.
std::pair<GemmTuningCache, std::string> open_capturing(const std::string& directory, const GemmTuningTarget& target) {
  ::testing::internal::CaptureStderr();
  GemmTuningCache cache(directory, target);
  return {std::move(cache), ::testing::internal::GetCapturedStderr()};
}

TEST(GemmTuningCache, SavedChoiceIsFoundByTheNextProcess) {
  TempDir dir;
  const std::string directory = dir.file("cache");
  {
    GemmTuningCache first(directory, kH100);
    EXPECT_EQ(first.loaded(), 0u);
    first.add(problem(4096, 14336, 4096), algorithm(1));
    first.add(problem(4096, 4096, 14336), algorithm(2));
  }
  auto [second, warnings] = open_capturing(directory, kH100);
  EXPECT_EQ(warnings, "");
  EXPECT_EQ(second.path(), directory + "/gemm-tuning-v2-nvidia-h100-80gb-hbm3-132sm-cublaslt130100.txt");
  EXPECT_EQ(second.loaded(), 2u);
  EXPECT_EQ(second.find(problem(4096, 14336, 4096)), algorithm(1));
  EXPECT_EQ(second.find(problem(4096, 4096, 14336)), algorithm(2));
}

TEST(GemmTuningCache, EveryPartOfTheProblemIsPartOfTheKey) {
  TempDir dir;
  GemmTuningCache cache(dir.file("cache"), kH100);
  const GemmProblem saved = problem(512, 384, 1024);
  cache.add(saved, algorithm(7));
  GemmTuningCache reloaded(dir.file("cache"), kH100);
  ASSERT_EQ(reloaded.find(saved), algorithm(7));

  std::vector<GemmProblem> others(13, saved);
  others[0].m = 513;
  others[1].n = 385;
  others[2].k = 1023;
  others[3].transpose_a = true;
  others[4].transpose_b = false;
  others[5].input_dtype = DType::F16;
  others[6].out_dtype = DType::F32;
  others[7].beta_zero = false;
  others[8].compute_type = 77;
  others[9].workspace_bytes = 4u << 20;
  others[10].epilogue = 36;
  others[11].ld_b = 15360;  // NOTE [Column-block GEMMs]
  others[12].ld_out = 15360;
  for (size_t i = 0; i < others.size(); ++i) EXPECT_FALSE(reloaded.find(others[i])) << "variant " << i;
}

TEST(GemmTuningCache, SerializedChoicesParseBackExactly) {
  GemmChoices choices;
  choices[problem(1, 8, 8)] = algorithm(3);
  GemmProblem other{1000, 200, 72, true, false, DType::BF16, DType::F32, false, 68, 32u << 20};
  choices[other] = GemmAlgorithm{0, ~0ull, 1, 2, 3, 4, 5, 0x8000000000000000ull};
  GemmProblem fused = problem(4096, 12288, 3072);
  fused.epilogue = 36;  // NOTE [GEMM epilogues]: written as "epilogue=36 " before "algo="
  choices[fused] = algorithm(9);
  GemmProblem block = problem(4608, 3072, 12288);
  block.ld_b = 15360;  // NOTE [Column-block GEMMs]: "ld=15360,0 " before "algo=", after any epilogue
  choices[block] = algorithm(10);
  GemmProblem fused_block = problem(3072, 12288, 4608);
  fused_block.epilogue = 36;
  fused_block.ld_out = 15360;
  choices[fused_block] = algorithm(11);
  ParsedGemmChoices parsed = parse_gemm_choices(serialize_gemm_choices(kH100, choices), kH100);
  EXPECT_EQ(parsed.error, "");
  EXPECT_EQ(parsed.choices, choices);
  EXPECT_EQ(parse_gemm_choices(serialize_gemm_choices(kH100, {}), kH100).error, "");
  EXPECT_NE(serialize_gemm_choices(kH100, choices).find(" epilogue=36 algo="), std::string::npos);
  EXPECT_NE(serialize_gemm_choices(kH100, choices).find(" ld=15360,0 algo="), std::string::npos);
  EXPECT_NE(serialize_gemm_choices(kH100, choices).find(" epilogue=36 ld=0,15360 algo="), std::string::npos);
}

TEST(GemmTuningCache, FileNameSpellsTheTarget) {
  EXPECT_EQ(gemm_tuning_file_name(kH100), "gemm-tuning-v2-nvidia-h100-80gb-hbm3-132sm-cublaslt130100.txt");
  EXPECT_EQ(gemm_tuning_file_name({"  NVIDIA  H200 / MIG 3g.71gb ", 60, 130201}),
            "gemm-tuning-v2-nvidia-h200-mig-3g-71gb-60sm-cublaslt130201.txt");
  EXPECT_EQ(gemm_tuning_file_name({"", 1, 2}), "gemm-tuning-v2-gpu-1sm-cublaslt2.txt");
  EXPECT_EQ(gemm_tuning_file_name(kH100, 1), "gemm-tuning-v1-nvidia-h100-80gb-hbm3-132sm-cublaslt130100.txt");
}

TEST(GemmTuningCache, OtherGpuOrLibraryIsNotUsedNorTouched) {
  TempDir dir;
  const std::string directory = dir.file("cache");
  GemmTuningCache h100(directory, kH100);
  h100.add(problem(64, 64, 64), algorithm(1));
  const std::string h100_file = read_file(h100.path());

  GemmTuningTarget other_gpu = kH100, other_partition = kH100, other_library = kH100;
  other_gpu.device_name = "NVIDIA H200";
  other_partition.multiprocessors = 66;
  other_library.cublaslt_version = 130200;
  for (const GemmTuningTarget& target : {other_gpu, other_partition, other_library}) {
    auto [cache, warnings] = open_capturing(directory, target);
    EXPECT_NE(cache.path(), h100.path());
    EXPECT_EQ(cache.loaded(), 0u);
    EXPECT_FALSE(cache.find(problem(64, 64, 64)));
    EXPECT_EQ(warnings, "");
    cache.add(problem(64, 64, 64), algorithm(2));
  }
  EXPECT_EQ(read_file(h100.path()), h100_file) << "other targets' saves leave this one's file alone";
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(directory), std::filesystem::directory_iterator()), 4);

  // A file holding another target's choices under this target's name (copied by hand) is
  // refused by its header.
  std::filesystem::copy_file(h100.path(), dir.file("cache/" + gemm_tuning_file_name(other_library)),
                             std::filesystem::copy_options::overwrite_existing);
  auto [cache, warnings] = open_capturing(directory, other_library);
  EXPECT_EQ(cache.loaded(), 0u);
  EXPECT_EQ(count_warnings(warnings), 1u) << warnings;
  EXPECT_NE(warnings.find("written for NVIDIA H100 80GB HBM3 (132 SMs), cuBLASLt 130100"), std::string::npos)
      << warnings;
}

struct Damage {
  std::string name;
  std::string (*apply)(const std::string& valid);
  std::string reported;  // what the warning says was wrong
};

TEST(GemmTuningCache, DamagedFileIsIgnoredWithOneWarningAndRewritten) {
  const Damage damages[] = {
      {"empty", [](const std::string&) { return std::string(); }, "empty"},
      {"cut mid-line", [](const std::string& v) { return v.substr(0, v.size() / 2); }, "truncated"},
      {"cut at a line", [](const std::string& v) { return v.substr(0, v.find("checksum")); }, "truncated"},
      {"last byte missing", [](const std::string& v) { return v.substr(0, v.size() - 1); }, "truncated"},
      {"bad magic", [](const std::string& v) { return "forge gemm tunin9" + v.substr(17); }, "bad magic"},
      {"other format version", [](const std::string& v) { return "forge gemm tuning 3" + v.substr(19); },
       "format version '3', this forge reads 1 to 2"},
      {"flipped byte in an algorithm",
       [](const std::string& v) {
         std::string d = v;
         d[d.find("algo=") + 20] ^= 0x01;
         return d;
       },
       "checksum mismatch"},
      {"flipped byte in the header",
       [](const std::string& v) {
         std::string d = v;
         d[d.find("H100")] = 'A';
         return d;
       },
       "checksum mismatch"},
      {"garbage", [](const std::string&) { return std::string("\x7f" "ELF\x02\x01\x01\0\0\0", 10); }, "bad magic"},
  };
  for (const Damage& damage : damages) {
    SCOPED_TRACE(damage.name);
    TempDir dir;
    const std::string directory = dir.file("cache");
    std::string path;
    {
      GemmTuningCache cache(directory, kH100);
      cache.add(problem(128, 256, 512), algorithm(1));
      path = cache.path();
    }
    write_file(path, damage.apply(read_file(path)));

    auto [cache, warnings] = open_capturing(directory, kH100);
    EXPECT_EQ(cache.loaded(), 0u);
    EXPECT_FALSE(cache.find(problem(128, 256, 512)));
    EXPECT_EQ(count_warnings(warnings), 1u) << warnings;
    EXPECT_NE(warnings.find(path), std::string::npos) << warnings;
    EXPECT_NE(warnings.find(damage.reported), std::string::npos) << warnings;

    ::testing::internal::CaptureStderr();
    cache.add(problem(8, 8, 8), algorithm(2));
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << "the save replaces the damaged file silently";
    ParsedGemmChoices rewritten = parse_gemm_choices(read_file(path), kH100);
    EXPECT_EQ(rewritten.error, "");
    EXPECT_EQ(rewritten.choices, (GemmChoices{{problem(8, 8, 8), algorithm(2)}}));
  }
}

TEST(GemmTuningCache, ChecksumIsFnv1aOfEverythingAboveIt) {
  const std::string text = serialize_gemm_choices(kH100, {{problem(8, 8, 8), algorithm(1)}});
  const std::string body = text.substr(0, text.find("checksum"));
  EXPECT_EQ(with_checksum(body), text);
}

TEST(GemmTuningCache, ALineThatDoesNotParseIsReported) {
  const std::string text = serialize_gemm_choices(kH100, {{problem(8, 8, 8), algorithm(1)}});
  std::string body = text.substr(0, text.find("checksum"));
  body.replace(body.find("a=N"), 3, "a=X");  // checksummed again below: only the line is wrong
  ParsedGemmChoices parsed = parse_gemm_choices(with_checksum(body), kH100);
  EXPECT_EQ(parsed.error, "line 5 is not a GEMM choice of format 2");
  EXPECT_TRUE(parsed.choices.empty());

  std::string header = text.substr(0, text.find("\ngemm ") + 1);
  header.replace(header.find("multiprocessors 132"), 19, "multiprocessors many");
  EXPECT_NE(parse_gemm_choices(with_checksum(header), kH100).error.find("not a number"), std::string::npos);
}

TEST(GemmTuningCache, WritersMergeEachOthersChoices) {
  TempDir dir;
  const std::string directory = dir.file("cache");
  // Two ranks open the (empty) cache at once and tune different shapes.
  GemmTuningCache rank0(directory, kH100), rank1(directory, kH100);
  rank0.add(problem(1, 2, 3), algorithm(1));
  rank1.add(problem(4, 5, 6), algorithm(2));
  rank0.add(problem(7, 8, 9), algorithm(3));
  EXPECT_EQ(rank0.find(problem(4, 5, 6)), algorithm(2)) << "a save takes in what others saved";

  GemmTuningCache next_run(directory, kH100);
  EXPECT_EQ(next_run.loaded(), 3u);
  EXPECT_EQ(next_run.find(problem(1, 2, 3)), algorithm(1));
  EXPECT_EQ(next_run.find(problem(4, 5, 6)), algorithm(2));
  EXPECT_EQ(next_run.find(problem(7, 8, 9)), algorithm(3));

  // A shape measured again (its cached choice was rejected) replaces the one on disk.
  next_run.add(problem(1, 2, 3), algorithm(4));
  EXPECT_EQ(GemmTuningCache(directory, kH100).find(problem(1, 2, 3)), algorithm(4));
  EXPECT_EQ(GemmTuningCache(directory, kH100).loaded(), 3u);
}

TEST(GemmTuningCache, UnwritableDirectoryIsOneWarningNotAFailure) {
  TempDir dir;
  write_file(dir.file("a-file"), "not a directory");
  const std::string directory = dir.file("a-file/cache");  // cannot be created, even by root
  auto [cache, open_warnings] = open_capturing(directory, kH100);
  EXPECT_EQ(open_warnings, "");
  ::testing::internal::CaptureStderr();
  cache.add(problem(1, 2, 3), algorithm(1));
  cache.add(problem(4, 5, 6), algorithm(2));
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_warnings(warnings), 1u) << warnings;
  EXPECT_NE(warnings.find(cache.path()), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("kept in memory only"), std::string::npos) << warnings;
  EXPECT_EQ(cache.find(problem(4, 5, 6)), algorithm(2)) << "the run still uses what it measured";
}

TEST(GemmTuningCache, UnreadableFileIsOneWarningAndLeftAlone) {
  TempDir dir;
  const std::string directory = dir.file("cache");
  const std::string path = directory + "/" + gemm_tuning_file_name(kH100);
  std::filesystem::create_directories(path);  // opens, but read() fails (EISDIR), even for root
  auto [cache, warnings] = open_capturing(directory, kH100);
  EXPECT_EQ(count_warnings(warnings), 1u) << warnings;
  EXPECT_NE(warnings.find(path + " cannot be read"), std::string::npos) << warnings;
  ::testing::internal::CaptureStderr();
  cache.add(problem(1, 2, 3), algorithm(1));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_TRUE(std::filesystem::is_directory(path)) << "nothing replaced what could not be read";
  EXPECT_EQ(cache.find(problem(1, 2, 3)), algorithm(1));
}

TEST(GemmTuningCache, DirectoryFollowsSettingThenEnvironment) {
  ScopedEnv forge_dir("FORGE_CACHE_DIR", "/forge-cache");
  ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
  ScopedEnv home("HOME", "/home/someone");
  EXPECT_EQ(gemm_tuning_cache_dir("/configured"), "/configured");
  EXPECT_EQ(gemm_tuning_cache_dir("relative/dir"), "relative/dir");
  EXPECT_EQ(gemm_tuning_cache_dir("off"), "");
  EXPECT_EQ(gemm_tuning_cache_dir(""), "/forge-cache");
  {
    ScopedEnv unset("FORGE_CACHE_DIR", std::nullopt);
    EXPECT_EQ(gemm_tuning_cache_dir(""), "/xdg/forge");
    {
      ScopedEnv relative_xdg("XDG_CACHE_HOME", "relative");  // invalid per the XDG spec
      EXPECT_EQ(gemm_tuning_cache_dir(""), "/home/someone/.cache/forge");
    }
    ScopedEnv empty_xdg("XDG_CACHE_HOME", "");
    EXPECT_EQ(gemm_tuning_cache_dir(""), "/home/someone/.cache/forge");
    ScopedEnv no_home("HOME", std::nullopt);
    EXPECT_EQ(gemm_tuning_cache_dir(""), "");
  }
  ScopedEnv empty_forge_dir("FORGE_CACHE_DIR", "");
  EXPECT_EQ(gemm_tuning_cache_dir(""), "/xdg/forge");
}

TEST(GemmTuningCache, SummaryLineSaysWhereAndHowMany) {
  GemmTuningStats stats;
  stats.shapes_tuned = 12;
  EXPECT_EQ(describe_gemm_tuning(stats),
            "GEMM tuning: 12 shapes timed, not kept on disk (training.gemm_tuning_cache is off or no cache "
            "directory is set)");
  stats.cache_file = "/c/gemm.txt";
  stats.choices_loaded = 40;
  stats.shapes_from_cache = 38;
  EXPECT_EQ(describe_gemm_tuning(stats),
            "GEMM tuning cache /c/gemm.txt: 40 choices loaded, 38 shapes taken from it, 12 timed and added");
  stats.cached_rejected = 2;
  EXPECT_NE(describe_gemm_tuning(stats).find("(2 cached choices rejected by cuBLASLt and timed again)"),
            std::string::npos);
}

}  // namespace
}  // namespace forge
