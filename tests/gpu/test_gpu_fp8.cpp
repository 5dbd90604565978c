// FP8 on the GPU (kernels/cuda/fp8_cast.h, fp8_matmul.h) against the CPU reference
// (kernels/cpu/fp8.h, fp8_scaling.h) on fresh random data with poisoned outputs:
//  - the casts, amax and tensorwise scales bit for bit (the cast is one fp32 product and a
//    round-to-nearest-even saturating conversion on both sides), over sizes that take the
//    vector and the scalar paths, buffers offset from their alignment, and special values
//    (+-inf, NaN, values that saturate, bf16 subnormals);
//  - the cast + transpose bit for bit, both outputs, over partial tiles;
//  - the cuBLASLt FP8 GEMM against the reference FP8 matmul for every scale mode cuBLAS
//    documents on sm_90 (NOTE [FP8 GEMM scale modes on sm_90]), E4M3 x E4M3, E4M3 x E5M2
//    and E5M2 x E4M3, bf16 and fp32 outputs, with and without fast accumulation, and
//    accumulation into the output (beta = 1); within a relative L2 error of 1e-2 for bf16
//    outputs and fast accumulation, 1e-3 for fp32 outputs (the reference sums in double;
//    Hopper's FP8 tensor cores keep fewer bits than fp32 between promotions, DeepSeek-V3's
//    report measured about 14, and a wrong factor or layout is off by far more);
//  - what cuBLASLt cannot run is refused with its reason before any GPU work;
//  - which scale-mode combinations this GPU's cuBLASLt has algorithms for (printed).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_testing.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/fp8_scaling.h"
#include "kernels/cuda/fp8_cast.h"
#include "kernels/cuda/fp8_matmul.h"

namespace forge {
namespace {

using cpu::Fp8Blocks;
using cpu::Fp8Format;
using cuda::Fp8GemmScaling;
using gpu_test::host_values;
using gpu_test::poisoned_gpu;
using gpu_test::seed_for_current_test;
using gpu_test::to_gpu;

constexpr Fp8Format kFormats[] = {Fp8Format::E4M3, Fp8Format::E5M2};

// bf16-exact values over many magnitudes (normal times e^(2 normal)), as fp32 on the CPU.
Tensor wide_values(int64_t n, Rng& rng) {
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i)
    t.data<float>()[i] = to_float(to_bf16(static_cast<float>(rng.normal() * std::exp(2.0 * rng.normal()))));
  return t;
}

template <typename T>
Tensor gpu_values(const std::vector<T>& v, DType dtype) {
  Tensor host = Tensor::empty({static_cast<int64_t>(v.size())}, dtype);
  std::memcpy(host.raw(), v.data(), v.size() * sizeof(T));
  return host.to(Device::CUDA);
}

Tensor gpu_scalar(float v) { return gpu_values(std::vector<float>{v}, DType::F32); }

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof(float)) == 0;
}

// Index of the first differing byte, or -1.
int64_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

float cpu_amax(const Tensor& x) {
  float amax = 0.0f;
  cpu::fp8_block_amax(x.data<float>(), 1, x.numel(), Fp8Blocks{1, x.numel()}, &amax);
  return amax;
}

std::vector<uint8_t> cpu_codes(const Tensor& x, float scale, Fp8Format format) {
  std::vector<uint8_t> q(static_cast<size_t>(x.numel()));
  cpu::fp8_quantize(x.data<float>(), 1, x.numel(), Fp8Blocks{1, x.numel()}, &scale, format, q.data());
  return q;
}

TEST(GpuFp8, CastAndAmaxMatchCpuBitwise) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {1, 7, 8, 1000, 4097, (1 << 20) + 3}) {
    Tensor x = wide_values(n, rng);
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e30f, -3e38f, 1e-40f, -2e-39f, 448.0f, 464.0f};
    for (size_t i = 0; i < std::size(specials) && static_cast<int64_t>(i) * 3 < n; ++i)
      x.data<float>()[i * 3] = to_float(to_bf16(specials[i]));
    const Tensor x_gpu = to_gpu(x, DType::BF16);
    for (Fp8Format format : kFormats)
      for (float scale : {1.0f, 0.37f, 1048576.0f, 3.0e-5f}) {
        const Tensor scale_gpu = gpu_scalar(scale);
        // The amax is folded into what the output holds (zero here: x's own amax).
        Tensor out = poisoned_gpu({n}, DType::U8), amax = Tensor::zeros({1}, DType::F32, Device::CUDA);
        cuda::fp8_cast(static_cast<const cuda::bf16*>(x_gpu.raw()), n, scale_gpu.data<float>(), format,
                       out.data<uint8_t>(), amax.data<float>());
        const std::vector<uint8_t> expected = cpu_codes(x, scale, format);
        EXPECT_EQ(first_difference(host_values<uint8_t>(out), expected), -1)
            << cpu::fp8_format_name(format) << " n " << n << " scale " << scale;
        EXPECT_TRUE(same_float(host_values<float>(amax)[0], cpu_amax(x))) << "n " << n;

        // Offset by one element: the scalar path.
        if (n > 1) {
          Tensor shifted_out = poisoned_gpu({n}, DType::U8);
          cuda::fp8_cast(static_cast<const cuda::bf16*>(x_gpu.raw()) + 1, n - 1, scale_gpu.data<float>(), format,
                         shifted_out.data<uint8_t>() + 1, nullptr);
          std::vector<uint8_t> got = host_values<uint8_t>(shifted_out);
          EXPECT_EQ(got[0], 0xff) << "wrote before its output";
          got.erase(got.begin());
          std::vector<uint8_t> want(expected.begin() + 1, expected.end());
          EXPECT_EQ(first_difference(got, want), -1) << "unaligned, n " << n;
        }
      }
  }
}

TEST(GpuFp8, AmaxIsOnTheDeviceAndPropagatesNan) {
  Rng rng(seed_for_current_test());
  Tensor x = wide_values(100003, rng);
  const Tensor amax = poisoned_gpu({1}, DType::F32);
  cuda::fp8_amax(static_cast<const cuda::bf16*>(to_gpu(x, DType::BF16).raw()), x.numel(), amax.data<float>());
  EXPECT_TRUE(same_float(host_values<float>(amax)[0], cpu_amax(x)));
  x.data<float>()[77777] = -NAN;
  cuda::fp8_amax(static_cast<const cuda::bf16*>(to_gpu(x, DType::BF16).raw()), x.numel(), amax.data<float>());
  EXPECT_TRUE(std::isnan(host_values<float>(amax)[0]));
  cuda::fp8_amax(nullptr, 0, amax.data<float>());
  EXPECT_EQ(host_values<float>(amax)[0], 0.0f);
}

TEST(GpuFp8, TensorwiseQuantizationMatchesTorchaoScalesBitwise) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {5, 65536, 3000001}) {
    const Tensor x = wide_values(n, rng);
    const Tensor x_gpu = to_gpu(x, DType::BF16);
    for (Fp8Format format : kFormats)
      for (bool power_of_2 : {false, true}) {
        Tensor out = poisoned_gpu({n}, DType::U8), amax = poisoned_gpu({1}, DType::F32);
        Tensor scale = poisoned_gpu({1}, DType::F32), scale_inv = poisoned_gpu({1}, DType::F32);
        // `seen` folds the amax in (NOTE [FP8 projection statistics]): a smaller value is
        // replaced, a larger one kept.
        const float larger = 3e38f;
        Tensor seen_host = Tensor::zeros({2});
        seen_host.data<float>()[1] = larger;
        const Tensor seen = to_gpu(seen_host, DType::F32);
        // Current (just-in-time) tensorwise scaling, as torchao's "tensorwise" recipe and TE's
        // Float8CurrentScaling: amax, scale, cast, all on the device.
        const auto* x_bf16 = static_cast<const cuda::bf16*>(x_gpu.raw());
        cuda::fp8_amax(x_bf16, n, amax.data<float>());
        cuda::fp8_scale_from_amax(amax.data<float>(), format, power_of_2, scale.data<float>(), scale_inv.data<float>(),
                                  seen.data<float>());
        cuda::fp8_cast(x_bf16, n, scale.data<float>(), format, out.data<uint8_t>(), nullptr);
        cuda::fp8_scale_from_amax(amax.data<float>(), format, power_of_2, scale.data<float>(), scale_inv.data<float>(),
                                  seen.data<float>() + 1);
        const float want_amax = cpu_amax(x);
        EXPECT_TRUE(same_float(host_values<float>(seen)[0], want_amax));
        EXPECT_EQ(host_values<float>(seen)[1], larger);
        const float want_scale = cpu::fp8_scale_torchao(want_amax, format, power_of_2);
        EXPECT_TRUE(same_float(host_values<float>(amax)[0], want_amax));
        EXPECT_TRUE(same_float(host_values<float>(scale)[0], want_scale))
            << host_values<float>(scale)[0] << " vs " << want_scale;
        EXPECT_TRUE(same_float(host_values<float>(scale_inv)[0], 1.0f / want_scale));
        EXPECT_EQ(first_difference(host_values<uint8_t>(out), cpu_codes(x, want_scale, format)), -1)
            << cpu::fp8_format_name(format) << " n " << n << " power of 2 " << power_of_2;
      }
  }
}

TEST(GpuFp8, CastTransposeMatchesCpuBitwise) {
  Rng rng(seed_for_current_test());
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {7, 13}, {64, 64}, {65, 129}, {333, 777}, {4096, 1000}, {1000, 4096}, {128, 192}, {256, 4096},
           {4096, 320}}) {
    const Tensor x = wide_values(rows * cols, rng);
    const Tensor x_gpu = to_gpu(x, DType::BF16);
    for (Fp8Format format : kFormats) {
      const float scale = 0.75f;
      const Tensor scale_gpu = gpu_scalar(scale);
      const std::vector<uint8_t> expected = cpu_codes(x, scale, format);
      std::vector<uint8_t> expected_t(expected.size());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) expected_t[c * rows + r] = expected[r * cols + c];
      Tensor out = poisoned_gpu({rows * cols}, DType::U8), out_t = poisoned_gpu({rows * cols}, DType::U8);
      Tensor amax = Tensor::zeros({1}, DType::F32, Device::CUDA);  // folded into: x's own amax
      cuda::fp8_cast_transpose(static_cast<const cuda::bf16*>(x_gpu.raw()), rows, cols, scale_gpu.data<float>(),
                               format, out.data<uint8_t>(), out_t.data<uint8_t>(), amax.data<float>());
      const std::string what = std::string(cpu::fp8_format_name(format)) + " " + std::to_string(rows) + "x" +
                               std::to_string(cols);
      EXPECT_EQ(first_difference(host_values<uint8_t>(out), expected), -1) << what;
      EXPECT_EQ(first_difference(host_values<uint8_t>(out_t), expected_t), -1) << what << " transposed";
      EXPECT_TRUE(same_float(host_values<float>(amax)[0], cpu_amax(x))) << what;

      Tensor only_t = poisoned_gpu({rows * cols}, DType::U8);
      cuda::fp8_cast_transpose(static_cast<const cuda::bf16*>(x_gpu.raw()), rows, cols, scale_gpu.data<float>(),
                               format, nullptr, only_t.data<uint8_t>(), nullptr);
      EXPECT_EQ(first_difference(host_values<uint8_t>(only_t), expected_t), -1) << what << " transpose only";
    }
  }
}

// One GEMM operand quantized by the CPU reference, and its codes and factors on the GPU.
struct Operand {
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // the reference's grid
  Fp8Blocks blocks;
  Tensor codes_gpu, factors_gpu;
  Fp8Format format;
  Fp8GemmScaling scaling;

  cpu::Fp8Operand reference() const { return {codes.data(), format, scales.data(), blocks}; }
  cuda::Fp8GemmOperand gpu() const {
    return {codes_gpu.data<uint8_t>(), format, factors_gpu.data<float>(), scaling};
  }
};

Operand quantize_operand(int64_t rows, int64_t k, Fp8Format format, Fp8GemmScaling scaling, Rng& rng) {
  Operand op;
  op.format = format;
  op.scaling = scaling;
  switch (scaling) {
    case Fp8GemmScaling::Tensor: op.blocks = {rows, k}; break;
    case Fp8GemmScaling::Row: op.blocks = {1, k}; break;
    case Fp8GemmScaling::Block1x128: op.blocks = {1, 128}; break;
    case Fp8GemmScaling::Block128x128: op.blocks = {128, 128}; break;
  }
  Tensor x = Tensor::empty({rows, k});
  for (int64_t i = 0; i < rows * k; ++i)  // rows and 128-blocks of different magnitudes
    x.data<float>()[i] = static_cast<float>(rng.normal() * std::exp2(static_cast<double>((i / k + (i % k) / 128) % 7)));
  std::vector<float> amax(static_cast<size_t>(cpu::fp8_scale_count(rows, k, op.blocks)));
  cpu::fp8_block_amax(x.data<float>(), rows, k, op.blocks, amax.data());
  op.scales.resize(amax.size());
  std::vector<float> inverse(amax.size());
  for (size_t i = 0; i < amax.size(); ++i) {
    op.scales[i] = scaling == Fp8GemmScaling::Tensor ? cpu::fp8_scale_torchao(amax[i], format, false)
                   : scaling == Fp8GemmScaling::Row  ? cpu::fp8_scale_torchao(amax[i], format, true)
                                                     : cpu::fp8_scale_transformer_engine(amax[i], format, true, 0.0f,
                                                                                         3.0e38f);
    inverse[i] = 1.0f / op.scales[i];
  }
  op.codes.resize(static_cast<size_t>(rows * k));
  cpu::fp8_quantize(x.data<float>(), rows, k, op.blocks, op.scales.data(), format, op.codes.data());
  op.codes_gpu = gpu_values(op.codes, DType::U8);
  op.factors_gpu = gpu_values(cuda::fp8_gemm_factor_layout(inverse.data(), rows, k, scaling), DType::F32);
  return op;
}

struct GemmCase {
  int64_t m, n, k;
  Fp8Format a_format, b_format;
  Fp8GemmScaling a_scaling, b_scaling;
  DType out_dtype;
  bool fast;
};

std::string describe(const GemmCase& c) {
  return std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k) + " " +
         cpu::fp8_format_name(c.a_format) + " " + cuda::fp8_gemm_scaling_name(c.a_scaling) + " x " +
         cpu::fp8_format_name(c.b_format) + " " + cuda::fp8_gemm_scaling_name(c.b_scaling) + " -> " +
         std::string(dtype_name(c.out_dtype)) + (c.fast ? " fast" : "");
}

void check_gemm(const GemmCase& c, Rng& rng, bool accumulate = false, cuda::GemmVarying varying = cuda::GemmVarying::None) {
  SCOPED_TRACE(describe(c));
  const bool supported = cuda::fp8_matmul_supported(c.out_dtype, c.a_format, c.a_scaling, c.b_format, c.b_scaling,
                                                    c.m, c.n, c.k, c.fast);
  // Per tensor must run. The outer-vector and block modes cuBLAS documents for sm_90 got no
  // algorithm from the device H100's cuBLASLt (README, FP8): skipped, naming the case.
  if (!supported && c.a_scaling != Fp8GemmScaling::Tensor)
    GTEST_SKIP() << "cuBLASLt offers no algorithm on this GPU for " << describe(c);
  ASSERT_TRUE(supported) << "cuBLASLt offers no algorithm for a per-tensor FP8 GEMM";
  const Operand a = quantize_operand(c.m, c.k, c.a_format, c.a_scaling, rng);
  const Operand b = quantize_operand(c.n, c.k, c.b_format, c.b_scaling, rng);
  Tensor expected = Tensor::empty({c.m, c.n});
  cpu::fp8_matmul_reference(a.reference(), b.reference(), c.m, c.n, c.k, expected.data<float>());
  Tensor out = poisoned_gpu({c.m, c.n}, c.out_dtype);
  if (accumulate) {
    const Tensor initial = gpu_test::random_bf16_values({c.m, c.n}, rng, 100.0);
    out = to_gpu(initial, c.out_dtype);
    for (int64_t i = 0; i < expected.numel(); ++i) expected.data<float>()[i] += initial.data<float>()[i];
  }
  cuda::fp8_matmul(out.raw(), c.out_dtype, a.gpu(), b.gpu(), c.m, c.n, c.k, 1.0f, accumulate ? 1.0f : 0.0f, c.fast,
                   varying);
  const double tolerance = c.out_dtype == DType::BF16 || c.fast ? 1e-2 : 1e-3;
  EXPECT_LT(gpu_test::relative_l2(gpu_test::to_cpu_f32(out), expected), tolerance);
}

TEST(GpuFp8Gemm, TensorwiseMatchesCpuReference) {
  Rng rng(seed_for_current_test());
  const std::pair<Fp8Format, Fp8Format> formats[] = {
      {Fp8Format::E4M3, Fp8Format::E4M3}, {Fp8Format::E4M3, Fp8Format::E5M2}, {Fp8Format::E5M2, Fp8Format::E4M3}};
  for (const auto& [m, n, k] : std::vector<std::array<int64_t, 3>>{{16, 16, 16}, {1000, 72, 512}, {1024, 512, 2048}})
    for (const auto& [fa, fb] : formats)
      for (DType out_dtype : {DType::BF16, DType::F32})
        for (bool fast : {false, true})
          check_gemm({m, n, k, fa, fb, Fp8GemmScaling::Tensor, Fp8GemmScaling::Tensor, out_dtype, fast}, rng);
  check_gemm({512, 256, 1024, Fp8Format::E4M3, Fp8Format::E4M3, Fp8GemmScaling::Tensor, Fp8GemmScaling::Tensor,
              DType::F32, false},
             rng, /*accumulate=*/true);
}

// NOTE [FP8 GEMMs of varying size]: a routed expert's sizes, several sharing a bucket's plan
// (its layouts reset to each call's size) and some not, in its three GEMMs (the forward and
// input gradient vary M, bf16 out; the weight gradient K, a multiple of 16, fp32 out, written
// over and added to), against the CPU reference.
TEST(GpuFp8Gemm, VaryingSizesShareAPlanAndMatchCpuReference) {
  Rng rng(seed_for_current_test());
  const Fp8GemmScaling t = Fp8GemmScaling::Tensor;
  for (int64_t rows : {200, 37, 3, 256, 1, 255, 300, 600, 37}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows");
    check_gemm({rows, 192, 128, Fp8Format::E4M3, Fp8Format::E4M3, t, t, DType::BF16, true}, rng, false,
               cuda::GemmVarying::M);
    check_gemm({rows, 128, 96, Fp8Format::E5M2, Fp8Format::E4M3, t, t, DType::BF16, false}, rng, false,
               cuda::GemmVarying::M);
    const int64_t padded = (rows + 15) / 16 * 16;
    for (bool added : {false, true})
      check_gemm({96, 128, padded, Fp8Format::E5M2, Fp8Format::E4M3, t, t, DType::F32, false}, rng, added,
                 cuda::GemmVarying::K);
  }
}

TEST(GpuFp8Gemm, RowwiseAndBlockwiseMatchCpuReference) {
  Rng rng(seed_for_current_test());
  using S = Fp8GemmScaling;
  const std::pair<S, S> modes[] = {
      {S::Row, S::Row}, {S::Block1x128, S::Block1x128}, {S::Block1x128, S::Block128x128},
      {S::Block128x128, S::Block1x128}};
  for (const auto& [m, n, k] : std::vector<std::array<int64_t, 3>>{{128, 128, 128}, {100, 264, 208}, {1024, 512, 2048}})
    for (const auto& [sa, sb] : modes)
      for (DType out_dtype : {DType::BF16, DType::F32})
        check_gemm({m, n, k, Fp8Format::E4M3, Fp8Format::E4M3, sa, sb, out_dtype, false}, rng);
  check_gemm({512, 512, 512, Fp8Format::E4M3, Fp8Format::E5M2, S::Row, S::Row, DType::BF16, true}, rng);
  check_gemm({512, 512, 512, Fp8Format::E5M2, Fp8Format::E4M3, S::Block1x128, S::Block128x128, DType::BF16, false},
             rng);
}

// Where the per-tensor scale pointers may sit: the inverse scales copied to byte offsets of
// one allocation, each offset with a shape of its own (so the heuristic query sees the
// offset pointers, as the linear ops' first call does) and again on a shape whose plan was
// found with aligned pointers. On the H100 cuBLASLt returned CUBLAS_STATUS_NOT_SUPPORTED
// at the matmul for 4, 8, 12 and 20 bytes and ran 16 and its multiples: fp8_matmul refuses
// a factor pointer that is not 16-byte aligned, naming the problem, before cuBLASLt sees it.
TEST(GpuFp8Gemm, ScalePointerAlignment) {
  Rng rng(seed_for_current_test());
  using S = Fp8GemmScaling;
  const int64_t k = 256, n = 256;
  const Operand b = quantize_operand(n, k, Fp8Format::E4M3, S::Tensor, rng);
  const Operand cached_a = quantize_operand(64, k, Fp8Format::E4M3, S::Tensor, rng);
  const Tensor cached_out = poisoned_gpu({64, n}, DType::BF16);
  cuda::fp8_matmul(cached_out.raw(), DType::BF16, cached_a.gpu(), b.gpu(), 64, n, k, 1.0f, 0.0f, false);
  const int64_t offsets[] = {256, 4, 8, 12, 16, 20, 32, 64, 128};
  for (size_t i = 0; i < std::size(offsets); ++i) {
    const int64_t offset = offsets[i], m = 128 + 16 * static_cast<int64_t>(i);
    const Operand a = quantize_operand(m, k, Fp8Format::E4M3, S::Tensor, rng);
    // Three 256-byte slots: a's, cached_a's and b's inverse scale, each `offset` bytes in.
    std::vector<float> host(3 * 64, std::nanf(""));
    const size_t at = static_cast<size_t>(offset / 4) % 64;
    host[at] = 1.0f / a.scales[0];
    host[64 + at] = 1.0f / cached_a.scales[0];
    host[128 + at] = 1.0f / b.scales[0];
    const Tensor factors = gpu_values(host, DType::F32);
    auto run = [&](const Operand& op, int64_t slot, const Tensor& out) -> std::string {
      const int64_t rows = op.codes_gpu.numel() / k;
      cuda::Fp8GemmOperand ga = op.gpu(), gb = b.gpu();
      ga.factors = factors.data<float>() + slot * 64 + static_cast<int64_t>(at);
      gb.factors = factors.data<float>() + 128 + static_cast<int64_t>(at);
      try {
        cuda::fp8_matmul(out.raw(), DType::BF16, ga, gb, rows, n, k, 1.0f, 0.0f, false);
      } catch (const std::exception& e) {
        return std::string("refused: ") + e.what();
      }
      Tensor expected = Tensor::empty({rows, n});
      cpu::fp8_matmul_reference(op.reference(), b.reference(), rows, n, k, expected.data<float>());
      const double error = gpu_test::relative_l2(gpu_test::to_cpu_f32(out), expected);
      return error < 1e-2 ? "ok" : "wrong result (relative L2 " + std::to_string(error) + ")";
    };
    const Tensor out = poisoned_gpu({m, n}, DType::BF16);
    const std::string fresh = run(a, 0, out), cached = run(cached_a, 1, cached_out);
    SCOPED_TRACE("scale pointers " + std::to_string(offset % 256) + " bytes past a 256-byte boundary");
    if (offset % 16 == 0) {
      EXPECT_EQ(fresh, "ok");
      EXPECT_EQ(cached, "ok");
    } else {
      for (const std::string& r : {fresh, cached})
        EXPECT_NE(r.find("the factors must start 16-byte aligned"), std::string::npos) << r;
    }
  }
}

TEST(GpuFp8Gemm, RefusesWhatCublasLtCannotRunWithTheReason) {
  Rng rng(seed_for_current_test());
  using S = Fp8GemmScaling;
  const Operand e4 = quantize_operand(64, 64, Fp8Format::E4M3, S::Tensor, rng);
  const Operand e5 = quantize_operand(64, 64, Fp8Format::E5M2, S::Tensor, rng);
  const Tensor out = poisoned_gpu({64, 64}, DType::BF16);
  auto refusal = [&](const cuda::Fp8GemmOperand& a, const cuda::Fp8GemmOperand& b, int64_t m, int64_t n, int64_t k,
                     bool fast) -> std::string {
    try {
      cuda::fp8_matmul(out.raw(), DType::BF16, a, b, m, n, k, 1.0f, 0.0f, fast);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(accepted)";
  };
  auto with = [](cuda::Fp8GemmOperand op, S scaling) {
    op.scaling = scaling;
    return op;
  };
  EXPECT_NE(refusal(e4.gpu(), e4.gpu(), 64, 64, 24, false).find("k = 24 is not a multiple of 16"), std::string::npos);
  EXPECT_NE(refusal(e5.gpu(), e5.gpu(), 64, 64, 64, false).find("both operands are E5M2"), std::string::npos);
  EXPECT_NE(refusal(e4.gpu(), e4.gpu(), 64, 60, 64, false).find("not a multiple of 16 bytes"), std::string::npos);
  EXPECT_NE(refusal(with(e4.gpu(), S::Row), e4.gpu(), 64, 64, 64, false).find("row scaling must be set for both"),
            std::string::npos);
  EXPECT_NE(refusal(with(e4.gpu(), S::Block128x128), with(e4.gpu(), S::Block128x128), 64, 64, 64, false)
                .find("128x128 blocks on both operands"),
            std::string::npos);
  EXPECT_NE(refusal(with(e4.gpu(), S::Block1x128), with(e4.gpu(), S::Block1x128), 64, 64, 64, true)
                .find("does not allow fast accumulation"),
            std::string::npos);
  EXPECT_NE(refusal(with(e4.gpu(), S::Block1x128), with(e4.gpu(), S::Block1x128), 62, 64, 64, false)
                .find("multiples of 4"),
            std::string::npos);
  EXPECT_EQ(host_values<uint16_t>(out), std::vector<uint16_t>(64 * 64, 0xffff)) << "a refused GEMM wrote its output";
}

// Which combinations this GPU's cuBLASLt runs, for the record (the test log); per tensor
// must be among them.
TEST(GpuFp8Gemm, ScaleModesThisGpuSupports) {
  using S = Fp8GemmScaling;
  const S all[] = {S::Tensor, S::Row, S::Block1x128, S::Block128x128};
  for (S sa : all)
    for (S sb : all)
      for (bool fast : {false, true}) {
        const bool ok = cuda::fp8_matmul_supported(DType::BF16, Fp8Format::E4M3, sa, Fp8Format::E4M3, sb, 4096,
                                                   4096, 4096, fast);
        std::printf("fp8 scale modes a %-15s b %-15s %s: %s\n", cuda::fp8_gemm_scaling_name(sa),
                    cuda::fp8_gemm_scaling_name(sb), fast ? "fast accumulation" : "full accumulation",
                    ok ? "supported" : "no");
        const bool block = sa == S::Block1x128 || sa == S::Block128x128;
        const bool documented = (sa == sb && !block) ||
                                (block && (sb == S::Block1x128 || sb == S::Block128x128) &&
                                 !(sa == S::Block128x128 && sb == S::Block128x128) && !fast);
        // Per tensor must be offered; the rest is recorded (README, FP8: none was on the H100).
        if (documented && sa == S::Tensor)
          EXPECT_TRUE(ok) << cuda::fp8_gemm_scaling_name(sa) << " x " << cuda::fp8_gemm_scaling_name(sb);
      }
}

}  // namespace
}  // namespace forge
