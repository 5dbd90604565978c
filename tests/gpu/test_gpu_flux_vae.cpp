// The FLUX VAE on the GPU against the CPU reference on fresh random data (gpu_testing.h):
// each op (the cuDNN convolution, with the image's 3 input and the decoder's 3 output
// channels, the 1x1 form and the padded stride-2 downsample; GroupNorm with and without
// SiLU, in place, over several pixel chunks and with a mean far from 0; nearest upsampling,
// the layout transposes, the latent scaling), the mid-block attention through the dense
// attention op (head dim C), and a whole small VAE's encode and decode in bf16 against fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu_testing.h"
#include "model/flux_vae.h"
#include "model/flux_vae_attention.h"
#include "ops/conv2d.h"
#include "ops/group_norm.h"
#include "ops/image_layout.h"
#include "ops/upsample.h"
#include "ops/vae_latents.h"

namespace forge::gpu_test {
namespace {

std::vector<float> values_of(const Tensor& t) {
  const float* p = t.data<float>();
  return {p, p + t.numel()};
}

struct ConvCase {
  Shape in;
  int64_t out_channels;
  Conv2dShape shape;
};

TEST(GpuFluxVaeOps, Conv2dMatchesCpu) {
  Rng rng(seed_for_current_test());
  const ConvCase cases[] = {
      {{2, 32, 24, 3}, 128, Conv2dShape::same(3)},   // the encoder's conv_in
      {{2, 16, 16, 128}, 3, Conv2dShape::same(3)},   // the decoder's conv_out
      {{1, 16, 16, 16}, 512, Conv2dShape::same(3)},  // the decoder's conv_in
      {{2, 12, 20, 256}, 512, Conv2dShape::same(1)}, // a shortcut
      {{2, 32, 32, 128}, 128, {3, 2, 0, 0, 1, 1}},   // the downsample
      {{1, 10, 14, 8}, 8, {3, 2, 0, 0, 1, 1}},
      {{2, 16, 16, 512}, 512, Conv2dShape::same(3)},
  };
  for (const ConvCase& c : cases) {
    const int64_t k = c.shape.kernel;
    const Shape out_shape = conv2d_out_shape(c.in, c.out_channels, c.shape);
    Tensor in = random_bf16_values(c.in, rng);
    Tensor w = random_bf16_values({c.out_channels, k, k, c.in[3]}, rng, 1.0 / std::sqrt(double(k * k * c.in[3])));
    Tensor bias = random_bf16_values({c.out_channels}, rng);
    Tensor out = Tensor::empty(out_shape);
    conv2d_forward(out, in, w, bias, c.shape);
    Tensor outg = poisoned_gpu(out_shape, DType::BF16);
    conv2d_forward(outg, to_gpu(in, DType::BF16), to_gpu(w, DType::BF16), to_gpu(bias, DType::BF16), c.shape);
    EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance) << shape_str(c.in) << " -> " << shape_str(out_shape);
  }
}

TEST(GpuFluxVaeOps, GroupNormMatchesCpu) {
  Rng rng(seed_for_current_test());
  const std::pair<Shape, int64_t> cases[] = {
      {{2, 16, 16, 128}, 32}, {{1, 100, 100, 64}, 32}, {{2, 5, 7, 12}, 4}, {{1, 3, 3, 512}, 32}, {{3, 1, 1, 8}, 4}};
  for (const auto& [shape, groups] : cases)
    for (bool silu : {false, true}) {
      Tensor x = random_bf16_values(shape, rng, 2.0);
      for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += 20.0f;  // a mean far from 0
      round_to_bf16(x);
      Tensor weight = random_bf16_values({shape.back()}, rng), bias = random_bf16_values({shape.back()}, rng);
      Tensor y = Tensor::empty(shape);
      group_norm_forward(y, x, weight, bias, {groups, 1e-6f, silu});
      Tensor xg = to_gpu(x, DType::BF16), wg = to_gpu(weight, DType::BF16), bg = to_gpu(bias, DType::BF16);
      Tensor yg = poisoned_gpu(shape, DType::BF16);
      group_norm_forward(yg, xg, wg, bg, {groups, 1e-6f, silu});
      EXPECT_LT(relative_l2(to_cpu_f32(yg), y), kBf16Tolerance) << shape_str(shape) << " silu " << silu;
      group_norm_forward(xg, xg, wg, bg, {groups, 1e-6f, silu});  // in place: the same bits
      EXPECT_EQ(host_values<uint16_t>(xg), host_values<uint16_t>(yg)) << shape_str(shape);
    }
}

TEST(GpuFluxVaeOps, UpsampleAndLayoutsCopyExactly) {
  Rng rng(seed_for_current_test());
  for (const Shape& shape : {Shape{2, 5, 7, 8}, Shape{1, 4, 6, 3}, Shape{2, 9, 3, 512}}) {
    Tensor x = random_bf16_values(shape, rng);
    const Shape up{shape[0], 2 * shape[1], 2 * shape[2], shape[3]};
    Tensor y = Tensor::empty(up), yg = poisoned_gpu(up, DType::BF16);
    upsample_nearest2x(y, x);
    upsample_nearest2x(yg, to_gpu(x, DType::BF16));
    EXPECT_EQ(values_of(to_cpu_f32(yg)), values_of(y)) << shape_str(shape);
  }
  for (const Shape& nchw : {Shape{2, 3, 17, 33}, Shape{1, 16, 40, 40}, Shape{2, 32, 5, 70}}) {
    const Shape nhwc{nchw[0], nchw[2], nchw[3], nchw[1]};
    Tensor x = random_bf16_values(nchw, rng);
    Tensor y = Tensor::empty(nhwc), yg = poisoned_gpu(nhwc, DType::BF16);
    nhwc_from_nchw(y, x);
    nhwc_from_nchw(yg, to_gpu(x, DType::BF16));
    EXPECT_EQ(values_of(to_cpu_f32(yg)), values_of(y)) << shape_str(nchw);
    Tensor back = poisoned_gpu(nchw, DType::BF16);
    nchw_from_nhwc(back, yg);
    EXPECT_EQ(values_of(to_cpu_f32(back)), values_of(x)) << shape_str(nchw);
  }
}

TEST(GpuFluxVaeOps, LatentScalingMatchesCpu) {
  Rng rng(seed_for_current_test());
  const int64_t batch = 2, channels = 16, h = 9, w = 13;
  const Shape latent{batch, channels, h, w};
  Tensor moments = random_bf16_values({batch, h, w, 2 * channels}, rng, 3.0);
  Tensor noise = random_bf16_values(latent, rng);
  Tensor momentsg = to_gpu(moments, DType::BF16);
  for (DType dtype : {DType::F32, DType::BF16})
    for (bool sample : {false, true}) {
      Tensor want = Tensor::empty(latent);
      vae_latents_from_moments(want, moments, sample ? &noise : nullptr, 0.3611f, 0.1159f);
      Tensor got = poisoned_gpu(latent, dtype), noiseg = to_gpu(noise, dtype);
      vae_latents_from_moments(got, momentsg, sample ? &noiseg : nullptr, 0.3611f, 0.1159f);
      EXPECT_LT(relative_l2(to_cpu_f32(got), want), dtype == DType::F32 ? 1e-5 : kBf16Tolerance)
          << dtype_name(dtype) << " sample " << sample;
      Tensor z = Tensor::empty({batch, h, w, channels}), zg = poisoned_gpu({batch, h, w, channels}, DType::BF16);
      vae_decoder_input(z, want, 0.3611f, 0.1159f);
      vae_decoder_input(zg, to_gpu(want, dtype), 0.3611f, 0.1159f);
      EXPECT_LT(relative_l2(to_cpu_f32(zg), z), kBf16Tolerance) << dtype_name(dtype);
    }
}

// NOTE [VAE mid-block attention]: the CUDA path (the dense attention op) against the CPU attention op.
TEST(GpuFluxVaeOps, MidBlockAttentionMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (const Shape& shape : {Shape{2, 64, 3, 512}, Shape{1, 300, 3, 64}}) {
    const int64_t batch = shape[0], seq = shape[1], channels = shape[3];
    Tensor qkv = random_bf16_values(shape, rng);
    Tensor out = Tensor::empty({batch, seq, channels});
    VaeActivationPool pool(Device::CPU, DType::F32);
    vae_attention(out, qkv, pool);
    VaeActivationPool poolg(Device::CUDA, DType::BF16);
    Tensor outg = poisoned_gpu({batch, seq, channels}, DType::BF16);
    vae_attention(outg, to_gpu(qkv, DType::BF16), poolg);
    EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance) << shape_str(shape);
  }
}

// A small VAE (two levels of 32 and 64 channels, FLUX's 16 latent channels, two ResNets per
// level, the attention) encoding and decoding in bf16 against fp32 on the same weights.
TEST(GpuFluxVae, EncodeAndDecodeMatchCpu) {
  Rng rng(seed_for_current_test());
  FluxVaeConfig config;
  config.name = "gpu-test";
  config.block_out_channels = {32, 64};
  config.norm_num_groups = 8;
  FluxVaeParameters cpu_params(config);
  cpu_params.initialize_random(seed_for_current_test());
  for (const Tensor& t : cpu_params.tensors()) round_to_bf16(t);
  FluxVaeParameters gpu_params(config, Device::CUDA, DType::BF16);
  gpu_params.assign_from(cpu_params);
  FluxVae cpu(cpu_params), gpu(gpu_params);

  const Shape image_shape{2, 3, 32, 48}, latent{2, 16, 16, 24};
  Tensor image = Tensor::empty(image_shape);
  for (int64_t i = 0; i < image.numel(); ++i) image.data<float>()[i] = static_cast<float>(2.0 * rng.uniform() - 1.0);
  round_to_bf16(image);
  Tensor noise = random_bf16_values(latent, rng);
  Tensor imageg = to_gpu(image, DType::BF16);

  Tensor moments = Tensor::empty({2, 32, 16, 24}), momentsg = poisoned_gpu({2, 32, 16, 24}, DType::BF16);
  cpu.encode_moments(moments, image);
  gpu.encode_moments(momentsg, imageg);
  EXPECT_LT(relative_l2(to_cpu_f32(momentsg), moments), 3e-2);

  Tensor latents = Tensor::empty(latent), latentsg = poisoned_gpu(latent, DType::F32);
  cpu.encode(latents, image, &noise);
  Tensor noiseg = to_gpu(noise, DType::F32);
  gpu.encode(latentsg, imageg, &noiseg);
  EXPECT_LT(relative_l2(to_cpu_f32(latentsg), latents), 3e-2);

  Tensor decoded = Tensor::empty(image_shape), decodedg = poisoned_gpu(image_shape, DType::BF16);
  cpu.decode(decoded, latents);
  gpu.decode(decodedg, to_gpu(latents, DType::F32));
  EXPECT_LT(relative_l2(to_cpu_f32(decodedg), decoded), 3e-2);
}

}  // namespace
}  // namespace forge::gpu_test
