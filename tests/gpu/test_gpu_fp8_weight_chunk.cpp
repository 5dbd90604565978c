// FSDP's FP8 all-gather kernels (ops/fp8_weight_chunk.h, kernels/cuda/fp8_weight_chunk.h;
// NOTE [FP8 all-gather] in distributed/fsdp.h) on fresh random data with poisoned outputs:
//  - the chunk amax, scales and cast of an fp32 master chunk bit for bit against what the
//    bf16-gather path computes: the chunk cast to bf16, then fp8_amax, fp8_scale_from_amax
//    and fp8_cast (the codes the gathered weight would get), over sizes that take the
//    vector and scalar paths, a chunk offset from its alignment, and values that saturate,
//    round to bf16 subnormals, or are infinite; the amax folded by the cast too;
//  - the byte transpose against the CPU loop, over partial tiles.
#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_testing.h"
#include "kernels/cpu/fp8_scaling.h"
#include "kernels/cuda/fp8_cast.h"
#include "ops/elementwise.h"
#include "ops/fp8_weight_chunk.h"

namespace forge {
namespace {

using gpu_test::host_values;
using gpu_test::poisoned_gpu;
using gpu_test::seed_for_current_test;

// fp32 values over many magnitudes (not bf16-exact: the kernels round them), a few special.
Tensor master_values(int64_t n, Rng& rng) {
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i)
    t.data<float>()[i] = static_cast<float>(rng.normal() * std::exp(2.0 * rng.normal()));
  if (n > 8) {
    t.data<float>()[1] = 1e30f;       // saturates
    t.data<float>()[2] = -3e-39f;     // a bf16 subnormal
    t.data<float>()[3] = -INFINITY;   // saturates to -448
  }
  return t;
}

TEST(GpuFp8WeightChunk, CodesAreTheBf16GatherPaths) {
  Rng rng(seed_for_current_test());
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{4096}, int64_t{100003}}) {
    for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " offset " << offset);
      const Tensor host = master_values(n + offset, rng);
      const Tensor chunk = host.to(Device::CUDA).narrow(offset, offset + n);
      // The bf16-gather path: bf16 copy, amax, scale, cast.
      Tensor bf16 = Tensor::empty({n}, DType::BF16, Device::CUDA);
      cast(bf16, chunk);
      Tensor stats = poisoned_gpu({3 * cpu::kFp8StatStride}, DType::F32);
      float* amax = stats.data<float>();
      float* scale = amax + cpu::kFp8StatStride;
      float* scale_inv = amax + 2 * cpu::kFp8StatStride;
      cuda::fp8_amax(static_cast<const cuda::bf16*>(bf16.raw()), n, amax);
      cuda::fp8_scale_from_amax(amax, cpu::Fp8Format::E4M3, false, scale, scale_inv);
      Tensor expected = poisoned_gpu({n}, DType::U8);
      cuda::fp8_cast(static_cast<const cuda::bf16*>(bf16.raw()), n, scale, cpu::Fp8Format::E4M3,
                     expected.data<uint8_t>(), nullptr);
      // The chunk path.
      Tensor chunk_amax = poisoned_gpu({1}, DType::F32);
      fp8_chunk_amax(chunk_amax, chunk);
      Tensor scales = poisoned_gpu({2 * cpu::kFp8StatStride}, DType::F32);
      fp8_chunk_scales(scales, chunk_amax);
      Tensor codes = poisoned_gpu({n}, DType::U8);
      Tensor folded = Tensor::zeros({1}, DType::F32, Device::CUDA);
      fp8_chunk_cast(codes, chunk, scales.narrow(0, 1), folded);
      const std::vector<float> want = host_values<float>(stats), got = host_values<float>(scales);
      EXPECT_EQ(host_values<uint32_t>(chunk_amax)[0], host_values<uint32_t>(stats)[0]);
      EXPECT_EQ(host_values<uint32_t>(folded)[0], host_values<uint32_t>(stats)[0]);
      EXPECT_EQ(std::memcmp(&got[0], &want[cpu::kFp8StatStride], 4), 0) << got[0] << " vs " << want[cpu::kFp8StatStride];
      EXPECT_EQ(std::memcmp(&got[cpu::kFp8StatStride], &want[2 * cpu::kFp8StatStride], 4), 0);
      EXPECT_EQ(host_values<uint8_t>(codes), host_values<uint8_t>(expected));
    }
  }
}

TEST(GpuFp8WeightChunk, TransposeIsTheCpuLoop) {
  Rng rng(seed_for_current_test());
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {33, 70}, {64, 32}, {257, 129}}) {
    SCOPED_TRACE(testing::Message() << rows << "x" << cols);
    Tensor host = Tensor::empty({rows, cols}, DType::U8);
    for (int64_t i = 0; i < host.numel(); ++i) host.data<uint8_t>()[i] = static_cast<uint8_t>(rng.next_u64());
    Tensor want = Tensor::empty({cols, rows}, DType::U8);
    fp8_transpose_codes(want, host);
    Tensor got = poisoned_gpu({cols, rows}, DType::U8);
    fp8_transpose_codes(got, host.to(Device::CUDA));
    EXPECT_EQ(host_values<uint8_t>(got), host_values<uint8_t>(want));
  }
}

}  // namespace
}  // namespace forge
