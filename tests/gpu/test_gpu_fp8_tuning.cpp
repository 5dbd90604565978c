// Measured algorithm choice for the FP8 GEMMs (NOTE [GEMM algorithm choice], fp8_matmul.cpp)
// on the GPU: with tuning on, the forms the FP8 linear ops run (forward: E4M3 x E4M3, bf16
// out, fast accumulation, beta 0 and 1; input gradient: E5M2 x E4M3, bf16 out; weight
// gradient: E5M2 x E4M3, fp32 out accumulating with beta 1) are timed on their own codes
// and factors and still match the CPU reference within the tolerances of the untuned test
// (test_gpu_fp8.cpp): 1e-2 relative L2 for bf16 outputs and fast accumulation, 1e-3 for
// fp32; beta 1 adds the product once. A later "process" (the plans forgotten) takes every
// choice from the tuning cache's fp8gemm entries without timing and computes the same bits.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gemm_tuning_testing.h"
#include "gpu_testing.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/fp8_scaling.h"
#include "kernels/cuda/fp8_matmul.h"
#include "kernels/cuda/matmul.h"
#include "ops/matmul.h"

namespace forge::gpu_test {
namespace {

using cpu::Fp8Blocks;
using cpu::Fp8Format;
using cuda::Fp8GemmScaling;

// One operand [rows, k] quantized per tensor by the CPU reference (torchao's scale), and
// its codes and inverse scale on the GPU.
struct TensorwiseOperand {
  std::vector<uint8_t> codes;
  float scale = 1.0f;
  Fp8Format format;
  Tensor codes_gpu, factor_gpu;

  TensorwiseOperand(int64_t rows, int64_t k, Fp8Format f, Rng& rng) : format(f) {
    const Tensor x = random_f32({rows, k}, rng, 3.0);
    const Fp8Blocks whole{rows, k};
    float amax = 0.0f;
    cpu::fp8_block_amax(x.data<float>(), rows, k, whole, &amax);
    scale = cpu::fp8_scale_torchao(amax, format, false);
    codes.resize(static_cast<size_t>(rows * k));
    cpu::fp8_quantize(x.data<float>(), rows, k, whole, &scale, format, codes.data());
    Tensor host_codes = Tensor::empty({rows * k}, DType::U8);
    std::memcpy(host_codes.raw(), codes.data(), codes.size());
    codes_gpu = host_codes.to(Device::CUDA);
    Tensor host_factor = Tensor::empty({1});
    host_factor.data<float>()[0] = 1.0f / scale;
    factor_gpu = host_factor.to(Device::CUDA);
  }

  cpu::Fp8Operand reference(int64_t rows, int64_t k) const {
    return {codes.data(), format, &scale, Fp8Blocks{rows, k}};
  }
  cuda::Fp8GemmOperand gpu() const {
    return {codes_gpu.data<uint8_t>(), format, factor_gpu.data<float>(), Fp8GemmScaling::Tensor};
  }
};

// One FP8 GEMM out[m, n] = a @ b^T (+ initial with beta 1), its operands and reference.
struct Fp8Case {
  std::string name;
  int64_t m, n, k;
  DType out_dtype;
  bool fast, accumulate;
  TensorwiseOperand a, b;
  Tensor initial;   // the output's starting values with beta 1, on the CPU (fp32, bf16-exact)
  Tensor expected;  // the CPU reference, initial included

  Fp8Case(std::string what, int64_t m_, int64_t n_, int64_t k_, Fp8Format a_format, Fp8Format b_format, DType out,
          bool fast_, bool accumulate_, Rng& rng)
      : name(std::move(what)), m(m_), n(n_), k(k_), out_dtype(out), fast(fast_), accumulate(accumulate_),
        a(m_, k_, a_format, rng), b(n_, k_, b_format, rng) {
    expected = Tensor::empty({m, n});
    cpu::fp8_matmul_reference(a.reference(m, k), b.reference(n, k), m, n, k, expected.data<float>());
    if (accumulate) {
      initial = random_bf16_values({m, n}, rng, 100.0);
      for (int64_t i = 0; i < expected.numel(); ++i) expected.data<float>()[i] += initial.data<float>()[i];
    }
  }

  double tolerance() const { return out_dtype == DType::BF16 || fast ? kBf16Tolerance : kF32Tolerance; }

  Tensor run() const {
    Tensor out = accumulate ? to_gpu(initial, out_dtype) : poisoned_gpu({m, n}, out_dtype);
    cuda::fp8_matmul(out.raw(), out_dtype, a.gpu(), b.gpu(), m, n, k, 1.0f, accumulate ? 1.0f : 0.0f, fast);
    return out;
  }
};

// The forms of one FP8 linear layer (NOTE [FP8 GEMM layout]) with 384 tokens, 896 in, 640
// out: shapes no other test uses.
std::vector<Fp8Case> linear_layer_cases(Rng& rng) {
  const int64_t tokens = 384, in = 896, out = 640;
  std::vector<Fp8Case> cases;
  cases.emplace_back("forward, beta 0", tokens, out, in, Fp8Format::E4M3, Fp8Format::E4M3, DType::BF16, true, false,
                     rng);
  cases.emplace_back("forward, beta 1", tokens, out, in, Fp8Format::E4M3, Fp8Format::E4M3, DType::BF16, true, true,
                     rng);
  cases.emplace_back("input gradient", tokens, in, out, Fp8Format::E5M2, Fp8Format::E4M3, DType::BF16, false, false,
                     rng);
  cases.emplace_back("weight gradient, beta 1", out, in, tokens, Fp8Format::E5M2, Fp8Format::E4M3, DType::F32, false,
                     true, rng);
  return cases;
}

bool bitwise_equal(const Tensor& gpu_a, const Tensor& gpu_b) {
  Tensor a = gpu_a.to(Device::CPU), b = gpu_b.to(Device::CPU);
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A fresh cache directory and no plans around each test (tests/gpu/gemm_tuning_testing.h).
class GpuFp8GemmTuning : public GemmTuningTest {};

TEST_F(GpuFp8GemmTuning, TunedGemmsMatchCpuReference) {
  Rng rng(seed_for_current_test());
  const std::vector<Fp8Case> cases = linear_layer_cases(rng);
  for (const Fp8Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Tensor out = c.run();
    EXPECT_LT(relative_l2(to_cpu_f32(out), c.expected), c.tolerance());
    // The plan is made now: a second call runs the chosen algorithm on its own.
    EXPECT_LT(relative_l2(to_cpu_f32(c.run()), c.expected), c.tolerance()) << "second call";
  }
  const GemmTuningStats stats = gemm_tuning_stats();
  EXPECT_EQ(stats.shapes_tuned, static_cast<int64_t>(cases.size())) << "each form is a problem of its own";
  EXPECT_EQ(stats.shapes_from_cache, 0);
}

TEST_F(GpuFp8GemmTuning, LaterRunTakesTheSavedChoicesAndComputesTheSameBits) {
  Rng rng(seed_for_current_test());
  const std::vector<Fp8Case> cases = linear_layer_cases(rng);
  std::vector<Tensor> tuned;
  for (const Fp8Case& c : cases) tuned.push_back(c.run());
  const GemmTuningStats first = gemm_tuning_stats();
  EXPECT_EQ(first.shapes_tuned, static_cast<int64_t>(cases.size()));
  ASSERT_FALSE(first.cache_file.empty());
  EXPECT_EQ(std::filesystem::path(first.cache_file).parent_path(), std::filesystem::path(directory_));
  const std::string file = read_file(first.cache_file);
  size_t fp8_lines = 0;
  for (size_t at = file.find("\nfp8gemm "); at != std::string::npos; at = file.find("\nfp8gemm ", at + 1)) ++fp8_lines;
  EXPECT_EQ(fp8_lines, cases.size()) << file;

  cuda::forget_gemm_plans();  // as a new process would start
  ::testing::internal::CaptureStderr();
  std::vector<Tensor> cached;
  for (const Fp8Case& c : cases) cached.push_back(c.run());
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  const GemmTuningStats second = gemm_tuning_stats();
  EXPECT_EQ(second.cache_file, first.cache_file);
  EXPECT_EQ(second.choices_loaded, static_cast<int64_t>(cases.size()));
  EXPECT_EQ(second.shapes_from_cache, static_cast<int64_t>(cases.size()));
  EXPECT_EQ(second.shapes_tuned, 0) << "nothing is timed again";
  EXPECT_EQ(second.cached_rejected, 0);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(cached[i], tuned[i])) << cases[i].name;
    EXPECT_LT(relative_l2(to_cpu_f32(cached[i]), cases[i].expected), cases[i].tolerance()) << cases[i].name;
  }
}

// The bf16 and FP8 GEMMs share one switch and one cache file: a bf16 GEMM of the forward's
// shape is a problem of its own, not the FP8 one's choice.
TEST_F(GpuFp8GemmTuning, Bf16AndFp8ShareTheCacheButNotTheirChoices) {
  Rng rng(seed_for_current_test());
  const std::vector<Fp8Case> cases = linear_layer_cases(rng);
  cases[0].run();
  const Tensor x = to_gpu(random_bf16_values({cases[0].m, cases[0].k}, rng), DType::BF16);
  const Tensor w = to_gpu(random_bf16_values({cases[0].n, cases[0].k}, rng), DType::BF16);
  Tensor y = poisoned_gpu({cases[0].m, cases[0].n}, DType::BF16);
  matmul(y, x, false, w, true);
  const GemmTuningStats stats = gemm_tuning_stats();
  EXPECT_EQ(stats.shapes_tuned, 2);
  EXPECT_EQ(stats.shapes_from_cache, 0);
  const std::string file = read_file(stats.cache_file);
  EXPECT_NE(file.find("\ngemm m=384 n=640 k=896 a=N b=T in=bf16 out=bf16 beta=zero "), std::string::npos) << file;
  EXPECT_NE(file.find("\nfp8gemm m=384 n=640 k=896 a=N b=T in=e4m3,e4m3 scale=0,0 accumulate=fast out=bf16 "
                      "beta=zero "),
            std::string::npos)
      << file;
}

}  // namespace
}  // namespace forge::gpu_test
