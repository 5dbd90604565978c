// The FP8 epilogues of the producer kernels (NOTE [FP8 fused producers] in
// ops/fp8_linear.h) on fresh random data with poisoned outputs: RMSNorm's and SwiGLU's
// forward output with its amax and E4M3 codes, SwiGLU's backward output with its amax. Each
// is checked bit for bit against the unfused path the projection would otherwise run: the
// kernel without the epilogue (the same bf16 output), then fp8_amax and fp8_cast over that
// output (kernels/cuda/fp8_cast.h, themselves bitwise the CPU reference, GpuFp8.*). Row
// widths cover RMSNorm's layouts (V = 1 to 8, a row in one or several slabs) and a NaN in
// the input must come out as a NaN amax, as the unfused amax gives.
#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_testing.h"
#include "kernels/cuda/fp8_cast.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/swiglu.h"

namespace forge {
namespace {

using namespace gpu_test;

cuda::bf16* bf16_ptr(const Tensor& t) { return static_cast<cuda::bf16*>(t.raw()); }

// The unfused quantization of y: its amax (fp8_amax) and E4M3 codes with `scale`.
struct Unfused {
  std::vector<uint32_t> amax;
  std::vector<uint8_t> codes;
};

Tensor gpu_scalar(float v) {
  Tensor host = Tensor::empty({1});
  host.data<float>()[0] = v;
  return host.to(Device::CUDA);
}

Unfused unfused(const Tensor& y, const Tensor& scale) {
  Tensor amax = poisoned_gpu({1}, DType::F32), codes = poisoned_gpu({y.numel()}, DType::U8);
  cuda::fp8_amax(bf16_ptr(y), y.numel(), amax.data<float>());
  cuda::fp8_cast(bf16_ptr(y), y.numel(), scale.data<float>(), cpu::Fp8Format::E4M3, codes.data<uint8_t>(), nullptr);
  return {host_values<uint32_t>(amax), host_values<uint8_t>(codes)};
}

// A zeroed amax, a poisoned code buffer and a scale for an epilogue over `numel` outputs.
struct Epilogue {
  Tensor amax, scale, codes;
  Epilogue(int64_t numel, float s)
      : amax(Tensor::zeros({1}, DType::F32, Device::CUDA)),
        scale(gpu_scalar(s)),
        codes(poisoned_gpu({numel}, DType::U8)) {}
  cuda::Fp8Epilogue with_codes() { return {amax.data<float>(), scale.data<float>(), codes.data<uint8_t>()}; }
  cuda::Fp8Epilogue amax_only() { return {amax.data<float>(), nullptr, nullptr}; }
};

TEST(GpuFp8Producers, RmsNormEpilogueIsTheUnfusedAmaxAndCast) {
  Rng rng(seed_for_current_test());
  // dim 64 (V 1), 1024 (V 1, 128 threads), 4096 (V 4), 8192 (V 4 on 256), 16384 (V 8), 24576 (slabs).
  for (const int64_t dim : {64, 1024, 4096, 8192, 16384, 24576}) {
    for (const bool codes : {false, true}) {
      SCOPED_TRACE(testing::Message() << "dim " << dim << (codes ? " with codes" : " amax only"));
      const int64_t rows = dim > 8192 ? 9 : 37;  // partial blocks
      Tensor x = to_gpu(random_bf16_values({rows, dim}, rng, 3.0), DType::BF16);
      Tensor w = to_gpu(random_bf16_values({dim}, rng), DType::BF16);
      Tensor y0 = poisoned_gpu({rows, dim}, DType::BF16), r0 = poisoned_gpu({rows}, DType::F32);
      Tensor y1 = poisoned_gpu({rows, dim}, DType::BF16), r1 = poisoned_gpu({rows}, DType::F32);
      cuda::rmsnorm_forward(bf16_ptr(y0), r0.data<float>(), bf16_ptr(x), bf16_ptr(w), rows, dim, 1e-5f);
      Epilogue e(rows * dim, 17.5f);
      cuda::rmsnorm_forward(bf16_ptr(y1), r1.data<float>(), bf16_ptr(x), bf16_ptr(w), rows, dim, 1e-5f,
                            codes ? e.with_codes() : e.amax_only());
      EXPECT_EQ(host_values<uint16_t>(y1), host_values<uint16_t>(y0));
      EXPECT_EQ(host_values<uint32_t>(r1), host_values<uint32_t>(r0));
      const Unfused want = unfused(y0, e.scale);
      EXPECT_EQ(host_values<uint32_t>(e.amax), want.amax);
      if (codes) EXPECT_TRUE(host_values<uint8_t>(e.codes) == want.codes);
      else EXPECT_EQ(host_values<uint8_t>(e.codes), std::vector<uint8_t>(static_cast<size_t>(rows * dim), 0xff));
    }
  }
}

TEST(GpuFp8Producers, SwigluEpiloguesAreTheUnfusedAmaxAndCast) {
  Rng rng(seed_for_current_test());
  for (const int64_t ffn : {8, 256, 14336}) {
    SCOPED_TRACE(testing::Message() << "ffn " << ffn);
    const int64_t rows = 19;
    Tensor gate_up = to_gpu(random_bf16_values({rows, 2 * ffn}, rng, 2.0), DType::BF16);
    Tensor dout = to_gpu(random_bf16_values({rows, ffn}, rng, 1e-3), DType::BF16);
    // Forward: out with its amax and codes.
    Tensor out0 = poisoned_gpu({rows, ffn}, DType::BF16), out1 = poisoned_gpu({rows, ffn}, DType::BF16);
    cuda::swiglu_forward(bf16_ptr(out0), bf16_ptr(gate_up), rows, ffn);
    Epilogue e(rows * ffn, 3.0f);
    cuda::swiglu_forward(bf16_ptr(out1), bf16_ptr(gate_up), rows, ffn, e.with_codes());
    EXPECT_EQ(host_values<uint16_t>(out1), host_values<uint16_t>(out0));
    const Unfused want = unfused(out0, e.scale);
    EXPECT_EQ(host_values<uint32_t>(e.amax), want.amax);
    EXPECT_TRUE(host_values<uint8_t>(e.codes) == want.codes);
    // Backward: dgate_up with its amax over both halves.
    Tensor d0 = poisoned_gpu({rows, 2 * ffn}, DType::BF16), d1 = poisoned_gpu({rows, 2 * ffn}, DType::BF16);
    cuda::swiglu_backward(bf16_ptr(d0), bf16_ptr(dout), bf16_ptr(gate_up), rows, ffn);
    Tensor amax = Tensor::zeros({1}, DType::F32, Device::CUDA);
    cuda::swiglu_backward(bf16_ptr(d1), bf16_ptr(dout), bf16_ptr(gate_up), rows, ffn, amax.data<float>());
    EXPECT_EQ(host_values<uint16_t>(d1), host_values<uint16_t>(d0));
    EXPECT_EQ(host_values<uint32_t>(amax), unfused(d0, e.scale).amax);
  }
}

TEST(GpuFp8Producers, NanInTheInputGivesANanAmax) {
  Rng rng(seed_for_current_test());
  const int64_t rows = 8, dim = 4096;
  Tensor host = random_bf16_values({rows, dim}, rng);
  host.data<float>()[3 * dim + 100] = NAN;  // row 3's output is all NaN
  Tensor x = to_gpu(host, DType::BF16), w = to_gpu(random_bf16_values({dim}, rng), DType::BF16);
  Tensor y = poisoned_gpu({rows, dim}, DType::BF16), r = poisoned_gpu({rows}, DType::F32);
  Epilogue e(rows * dim, 1.0f);
  cuda::rmsnorm_forward(bf16_ptr(y), r.data<float>(), bf16_ptr(x), bf16_ptr(w), rows, dim, 1e-5f, e.with_codes());
  EXPECT_TRUE(std::isnan(host_values<float>(e.amax)[0]));
  EXPECT_EQ(host_values<uint32_t>(e.amax), unfused(y, e.scale).amax);
}

}  // namespace
}  // namespace forge
