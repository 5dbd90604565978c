// NOTE [FP8 straight from NF4] (ops/nf4_fp8.h): QLoRA's frozen NF4 base under FP8 cast to
// E4M3 codes straight from its NF4 codes. The kernels against the unfused path (NF4
// dequantized to bf16, then fp8_amax and fp8_cast of it) on fresh random weights, codes and
// amax bit for bit, aligned and not; and the linear ops with the fused path against the same
// ops with the unfused one (a workspace without nf4_stats), for tensorwise (with and without
// forward statistics) and delayed scaling: outputs and W's recorded amax bit for bit. The
// unfused path itself is checked against the CPU reference in GpuQloraFp8.*.
#include <algorithm>
#include <array>
#include <vector>

#include "gpu_testing.h"

#include "kernels/cpu/fp8_scaling.h"
#include "kernels/cuda/fp8_cast.h"
#include "kernels/cuda/nf4_fp8.h"
#include "ops/fp8_statistics.h"
#include "ops/linear.h"
#include "ops/nf4.h"

namespace forge {
namespace {

using namespace gpu_test;
using cpu::Fp8Role;

TEST(GpuNf4Fp8, KernelsMatchDequantizeThenCastBitwise) {
  Rng rng(seed_for_current_test());
  for (const Shape& shape : std::vector<Shape>{{1, 1}, {7, 9}, {5, 13}, {3, 100}, {64, 64}, {333, 777}, {1024, 4096}}) {
    SCOPED_TRACE(shape_str(shape));
    const int64_t n = shape_numel(shape);
    const Nf4Tensor q = nf4_quantize(random_bf16_values(shape, rng, 0.02)).to(Device::CUDA);
    Tensor dequantized = poisoned_gpu(shape, DType::BF16);
    nf4_dequantize(dequantized, q);
    Tensor stats = Tensor::zeros({4}, DType::F32, Device::CUDA);  // expected amax, fused amax, scale, cast amax
    float* s = stats.data<float>();
    cuda::fp8_amax(static_cast<const cuda::bf16*>(dequantized.raw()), n, s);
    cuda::nf4_fp8_amax(q.codes.data<uint8_t>(), q.absmax_codes.data<uint8_t>(), q.absmax_scales.data<float>(),
                       q.absmax_offset, n, s + 1);
    const std::vector<float> amax = host_values<float>(stats);
    EXPECT_EQ(amax[0], amax[1]) << "amax";
    EXPECT_GT(amax[0], 0.0f);
    const float scale = 448.0f / amax[0];
    copy_bytes(s + 2, Device::CUDA, &scale, Device::CPU, sizeof(float));
    Tensor expected = poisoned_gpu({n}, DType::U8);
    cuda::fp8_cast(static_cast<const cuda::bf16*>(dequantized.raw()), n, s + 2, Fp8Format::E4M3, expected.data<uint8_t>(), nullptr);
    // Aligned, and one byte into the buffer (the scalar path).
    Tensor padded = poisoned_gpu({n + 1}, DType::U8);
    for (const int64_t at : {int64_t{0}, int64_t{1}}) {
      Tensor out = padded.narrow(at, at + n);
      cuda::nf4_fp8_cast(q.codes.data<uint8_t>(), q.absmax_codes.data<uint8_t>(), q.absmax_scales.data<float>(),
                         q.absmax_offset, n, s + 2, out.data<uint8_t>(), s + 3);
      EXPECT_EQ(host_values<uint8_t>(out), host_values<uint8_t>(expected)) << "codes at offset " << at;
      EXPECT_EQ(host_values<float>(stats)[3], amax[0]) << "the cast's folded amax";
    }
  }
}

struct Recipe {
  const char* name;
  bool delayed, forward_stats;
};

TEST(GpuNf4Fp8, LinearOpsGiveTheUnfusedBits) {
  Rng rng(seed_for_current_test());
  for (const auto& [tokens, in, out] : std::vector<std::array<int64_t, 3>>{{32, 64, 16}, {1008, 208, 96},
                                                                          {2048, 1024, 768}}) {
    Nf4Weight stacked;  // as forge's fused gate_up: two Hugging Face tensors
    stacked.parts.push_back(nf4_quantize(random_bf16_values({out / 2, in}, rng, 0.02)));
    stacked.parts.push_back(nf4_quantize(random_bf16_values({out - out / 2, in}, rng, 0.03)));
    const Nf4Weight q = stacked.to(Device::CUDA);
    const Tensor x = to_gpu(random_bf16_values({tokens, in}, rng), DType::BF16);
    const Tensor dy = to_gpu(random_bf16_values({tokens, out}, rng, 1e-3), DType::BF16);
    const Tensor residual = to_gpu(random_bf16_values({tokens, out}, rng), DType::BF16);
    const int64_t codes = std::max({tokens * in, tokens * out, out * in});
    for (const Recipe recipe : {Recipe{"tensorwise", false, false}, Recipe{"tensorwise, forward statistics", false, true},
                                Recipe{"delayed", true, false}}) {
      SCOPED_TRACE(::testing::Message() << tokens << "x" << in << "x" << out << " " << recipe.name);
      struct Side {
        Fp8LinearWorkspace ws;
        Tensor stats, forward_stats, scratch;
        Fp8ForwardStats forward;
        Fp8Linear fp8;
      };
      auto make_side = [&](bool straight) {
        Side side{{poisoned_gpu({codes}, DType::U8), poisoned_gpu({codes}, DType::U8), poisoned_gpu({codes}, DType::U8),
                   poisoned_gpu({kFp8WorkspaceStats}, DType::F32)}};
        if (straight) side.ws.nf4_stats = poisoned_gpu({3 * cpu::kFp8StatStride}, DType::F32);
        side.stats = poisoned_gpu({cpu::kFp8ProjectionStats}, DType::F32);
        fp8_stats_init(side.stats);
        if (recipe.delayed) {  // scales as a step end would have set them
          Tensor host = side.stats.to(Device::CPU);
          const float scales[] = {448.0f / 3.0f, 448.0f / 0.05f, 57344.0f / 4e-3f};  // x, W, dy
          for (int r = 0; r < cpu::kFp8Roles; ++r) {
            host.data<float>()[cpu::fp8_scale_offset(0, static_cast<Fp8Role>(r))] = scales[r];
            host.data<float>()[cpu::fp8_scale_inv_offset(0, static_cast<Fp8Role>(r))] = 1.0f / scales[r];
          }
          side.stats.copy_from(host);
        }
        side.forward_stats = poisoned_gpu({kFp8WorkspaceStats}, DType::F32);
        side.scratch = poisoned_gpu({out, in}, DType::BF16);
        return side;
      };
      Side fused = make_side(true), unfused = make_side(false);
      for (Side* side : {&fused, &unfused}) {
        side->forward = Fp8ForwardStats{side->forward_stats.data<float>()};
        side->fp8 = Fp8Linear{Fp8Format::E5M2, &side->ws, recipe.forward_stats ? &side->forward : nullptr,
                              side->stats.data<float>(), recipe.delayed};
      }
      const LinearWeight fused_w{.weight = fused.scratch, .nf4 = &q, .fp8 = &fused.fp8};
      const LinearWeight unfused_w{.weight = unfused.scratch, .nf4 = &q, .fp8 = &unfused.fp8};

      Tensor y = poisoned_gpu({tokens, out}, DType::BF16), y_unfused = poisoned_gpu({tokens, out}, DType::BF16);
      linear_forward(y, x, fused_w, &residual);
      linear_forward(y_unfused, x, unfused_w, &residual);
      EXPECT_EQ(host_values<uint16_t>(y), host_values<uint16_t>(y_unfused)) << "forward with a residual";
      Tensor dx = poisoned_gpu({tokens, in}, DType::BF16), dx_unfused = poisoned_gpu({tokens, in}, DType::BF16);
      linear_backward_input(dx, dy, fused_w);
      linear_backward_input(dx_unfused, dy, unfused_w);
      EXPECT_EQ(host_values<uint16_t>(dx), host_values<uint16_t>(dx_unfused)) << "input gradient";
      linear_backward_input_add(dx, dy, fused_w);
      linear_backward_input_add(dx_unfused, dy, unfused_w);
      EXPECT_EQ(host_values<uint16_t>(dx), host_values<uint16_t>(dx_unfused)) << "input gradient added";
      linear_forward(y, x, fused_w);
      linear_forward(y_unfused, x, unfused_w);
      EXPECT_EQ(host_values<uint16_t>(y), host_values<uint16_t>(y_unfused)) << "forward";
      const std::vector<float> a = host_values<float>(fused.stats), b = host_values<float>(unfused.stats);
      const int64_t seen = cpu::fp8_seen_offset(0, Fp8Role::W);
      EXPECT_EQ(a[static_cast<size_t>(seen)], b[static_cast<size_t>(seen)]) << "W's recorded amax";
      EXPECT_GT(a[static_cast<size_t>(seen)], 0.0f);
    }
  }
}

}  // namespace
}  // namespace forge
