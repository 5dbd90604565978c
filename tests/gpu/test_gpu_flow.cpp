// The rectified-flow ops on the GPU against the CPU reference on fresh random data
// (gpu_testing.h): patchify both ways, counter-based normals, the flow-matching pair and
// the MSE loss, in fp32 and bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "gpu_testing.h"
#include "ops/flow_matching.h"
#include "ops/patchify.h"
#include "ops/random_normal.h"

namespace forge::gpu_test {
namespace {

constexpr DType kDtypes[] = {DType::F32, DType::BF16};

// A permutation: the GPU moves exactly the values the CPU does, in both dtypes.
TEST(GpuPatchify, BothWaysEqualCpu) {
  Rng rng(seed_for_current_test());
  struct Case {
    int64_t batch, channels, height, width, patch;
  };
  for (const Case& c : {Case{1, 1, 2, 2, 2}, Case{2, 16, 64, 48, 2}, Case{3, 5, 9, 12, 3}}) {
    const Shape latent_shape{c.batch, c.channels, c.height, c.width};
    const Shape token_shape{c.batch, (c.height / c.patch) * (c.width / c.patch), c.channels * c.patch * c.patch};
    Tensor latents = random_bf16_values(latent_shape, rng), tokens = random_bf16_values(token_shape, rng);
    Tensor want_tokens = Tensor::empty(token_shape), want_latents = Tensor::empty(latent_shape);
    patchify(want_tokens, latents, c.patch);
    unpatchify(want_latents, tokens, c.patch);
    for (DType dtype : kDtypes) {
      Tensor got_tokens = poisoned_gpu(token_shape, dtype), got_latents = poisoned_gpu(latent_shape, dtype);
      patchify(got_tokens, to_gpu(latents, dtype), c.patch);
      unpatchify(got_latents, to_gpu(tokens, dtype), c.patch);
      EXPECT_EQ(relative_l2(to_cpu_f32(got_tokens), want_tokens), 0.0) << dtype_name(dtype) << " " << c.channels;
      EXPECT_EQ(relative_l2(to_cpu_f32(got_latents), want_latents), 0.0) << dtype_name(dtype) << " " << c.channels;
    }
  }
}

// fp32: the same numbers up to the last bits of logf/sqrtf/sinf/cosf; bf16: those rounded.
TEST(GpuRandomNormal, MatchesCpuAtAnyOffset) {
  const uint64_t seed = seed_for_current_test();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4099}, int64_t{1} << 20}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{1}, uint64_t{6}, (uint64_t{1} << 34) + 3}) {
      Tensor want = Tensor::empty({n});
      random_normal(want, seed, offset);
      Tensor got32 = poisoned_gpu({n}, DType::F32), got16 = poisoned_gpu({n}, DType::BF16);
      random_normal(got32, seed, offset);
      random_normal(got16, seed, offset);
      const Tensor f32 = to_cpu_f32(got32), bf16 = to_cpu_f32(got16);
      double worst32 = 0, worst16 = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double w = want.data<float>()[i];
        worst32 = std::max(worst32, std::abs(f32.data<float>()[i] - w));
        worst16 = std::max(worst16, std::abs(bf16.data<float>()[i] - w) / (std::abs(w) * 0x1p-8 + 1e-5));
        if (!std::isfinite(f32.data<float>()[i]) || !std::isfinite(bf16.data<float>()[i])) worst32 = INFINITY;
      }
      EXPECT_LE(worst32, 1e-5) << n << " from " << offset;
      EXPECT_LE(worst16, 1.0) << n << " from " << offset;  // within one bf16 step of the CPU's value
    }
  }
}

TEST(GpuFlowMatching, PairMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (const Shape& shape : {Shape{1, 1, 1}, Shape{3, 37, 64}, Shape{4, 4096, 64}}) {
    Tensor x0 = random_bf16_values(shape, rng), noise = random_bf16_values(shape, rng);
    Tensor t = Tensor::empty({shape[0]});
    for (int64_t b = 0; b < shape[0]; ++b) t.data<float>()[b] = static_cast<float>(rng.uniform());
    Tensor noisy = Tensor::empty(shape), target = Tensor::empty(shape);
    flow_matching_pair(noisy, target, x0, noise, t);
    for (DType dtype : kDtypes) {
      Tensor got_noisy = poisoned_gpu(shape, dtype), got_target = poisoned_gpu(shape, dtype);
      flow_matching_pair(got_noisy, got_target, to_gpu(x0, dtype), to_gpu(noise, dtype), t.to(Device::CUDA));
      const double tolerance = dtype == DType::F32 ? 1e-6 : kBf16Tolerance;
      EXPECT_LT(relative_l2(to_cpu_f32(got_noisy), noisy), tolerance) << dtype_name(dtype);
      EXPECT_LT(relative_l2(to_cpu_f32(got_target), target), tolerance) << dtype_name(dtype);
    }
  }
}

// The loss from bf16 inputs is summed in fp32 from exactly the CPU's values, so it matches
// closely in both dtypes; a second run gives the same bits (no atomics).
TEST(GpuMseLoss, MatchesCpuAndIsDeterministic) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3} * 1024 * 1024 + 17}) {
    Tensor pred = random_bf16_values({n}, rng), target = random_bf16_values({n}, rng);
    Tensor loss = Tensor::empty({1}), dpred = Tensor::empty({n});
    loss.data<float>()[0] = 0.25f;
    mse_loss(loss, dpred, pred, target, 0.5f);
    for (DType dtype : kDtypes) {
      Tensor gp = to_gpu(pred, dtype), gt = to_gpu(target, dtype);
      std::vector<uint32_t> first_loss;
      std::vector<uint16_t> first_grad;
      for (int run = 0; run < 2; ++run) {
        Tensor got_loss = Tensor::empty({1});
        got_loss.data<float>()[0] = 0.25f;
        got_loss = got_loss.to(Device::CUDA);
        Tensor got_grad = poisoned_gpu({n}, dtype);
        mse_loss(got_loss, got_grad, gp, gt, 0.5f);
        const float l = to_cpu_f32(got_loss).data<float>()[0];
        EXPECT_NEAR(l, loss.data<float>()[0], 1e-5 * loss.data<float>()[0]) << dtype_name(dtype) << " " << n;
        EXPECT_LT(relative_l2(to_cpu_f32(got_grad), dpred), dtype == DType::F32 ? 1e-6 : kBf16Tolerance)
            << dtype_name(dtype) << " " << n;
        const std::vector<uint32_t> loss_bits = host_values<uint32_t>(got_loss);
        const std::vector<uint16_t> grad_bits = host_values<uint16_t>(got_grad);
        if (run == 0) {
          first_loss = loss_bits;
          first_grad = grad_bits;
        } else {
          EXPECT_EQ(loss_bits, first_loss) << dtype_name(dtype) << " " << n;
          EXPECT_EQ(grad_bits, first_grad) << dtype_name(dtype) << " " << n;
        }
      }
    }
  }
}

}  // namespace
}  // namespace forge::gpu_test
