// The FLUX latent cache with device tensors (NOTE [FLUX latent cache]): a cache written from
// CUDA tensors (as forge prep --images --device cuda appends the encoders' bf16 output and the
// VAE's fp32 latents) holds what the same values written from the host hold, and read() into
// CUDA tensors of fp32 and bf16 gives, bit for bit, what it gives into host tensors.
#include <gtest/gtest.h>

#include <cstring>

#include "../cpu/test_data_temp_dir.h"
#include "ckpt/flux_latent_cache.h"
#include "gpu_testing.h"

namespace forge::gpu_test {
namespace {

TEST(GpuFluxLatentCache, WritesFromAndReadsIntoDeviceTensors) {
  Rng rng(seed_for_current_test());
  TempDir dir;
  const int64_t n = 3;
  const Tensor latents = random_f32({n, 16, 4, 2}, rng), text = random_bf16_values({n, 5, 8}, rng),
               pooled = random_bf16_values({n, 6}, rng);
  const std::vector<std::string> images = {"a", "b", "c"}, captions = {"x", "y", "z"};
  for (DType stored : {DType::F32, DType::BF16}) {
    FluxCacheWriterOptions o;
    o.text_tokens = 5;
    o.context_dim = 8;
    o.pooled_dim = 6;
    o.dtype = stored;
    const std::string from_host = dir.file(std::string("host-") + std::string(dtype_name(stored)));
    const std::string from_device = dir.file(std::string("device-") + std::string(dtype_name(stored)));
    {
      FluxLatentCacheWriter host(from_host, o), device(from_device, o);
      host.append(16, 32, latents, text.clone(), pooled.clone(), images, captions);
      device.append(16, 32, to_gpu(latents, DType::F32), to_gpu(text, DType::BF16), to_gpu(pooled, DType::BF16), images,
                    captions);
      host.finish();
      device.finish();
    }
    const FluxLatentCache a(from_host), b(from_device);
    for (DType into : {DType::F32, DType::BF16}) {
      const std::vector<int64_t> order = {2, 0, 1};
      Tensor hl = Tensor::empty({n, 16, 4, 2}, into), ht = Tensor::empty({n, 5, 8}, into),
             hp = Tensor::empty({n, 6}, into);
      a.read(order, hl, ht, hp);
      Tensor dl = poisoned_gpu({n, 16, 4, 2}, into), dt = poisoned_gpu({n, 5, 8}, into),
             dp = poisoned_gpu({n, 6}, into);
      b.read(order, dl, dt, dp);
      for (const auto& [host, device] : {std::pair{hl, dl}, std::pair{ht, dt}, std::pair{hp, dp}}) {
        const Tensor back = device.to(Device::CPU);
        EXPECT_EQ(std::memcmp(back.raw(), host.raw(), host.nbytes()), 0)
            << "stored " << dtype_name(stored) << ", read into " << dtype_name(into);
      }
    }
  }
}

// NOTE [FLUX caption dropout], NOTE [FLUX posterior latents]: a read that drops captions and
// samples latents into CUDA tensors gives, bit for bit, what it gives into host tensors.
TEST(GpuFluxLatentCache, DroppedCaptionsAndSampledLatentsIntoDeviceTensors) {
  Rng rng(seed_for_current_test());
  TempDir dir;
  const int64_t n = 3;
  FluxCacheWriterOptions o;
  o.text_tokens = 5;
  o.context_dim = 8;
  o.pooled_dim = 6;
  o.dtype = DType::BF16;
  o.latents = "distribution";
  o.scaling_factor = 0.3611;
  o.shift_factor = 0.1159;
  const std::string folder = dir.file("posterior");
  {
    FluxLatentCacheWriter writer(folder, o);
    writer.append(16, 32, random_f32({n, 32, 4, 2}, rng), random_f32({n, 5, 8}, rng), random_f32({n, 6}, rng),
                  {"a", "b", "c"}, {"x", "y", "z"});
    writer.set_empty_prompt(random_f32({1, 5, 8}, rng), random_f32({1, 6}, rng));
    writer.finish();
  }
  const FluxLatentCache cache(folder);
  const Tensor eps = random_f32({n, 16, 4, 2}, rng);
  FluxCacheReadOptions options;
  options.empty_caption = {0, 1, 1};
  options.latent_noise = &eps;
  for (DType into : {DType::F32, DType::BF16}) {
    const std::vector<int64_t> order = {1, 2, 0};
    Tensor hl = Tensor::empty({n, 16, 4, 2}, into), ht = Tensor::empty({n, 5, 8}, into),
           hp = Tensor::empty({n, 6}, into);
    cache.read(order, hl, ht, hp, options);
    Tensor dl = poisoned_gpu({n, 16, 4, 2}, into), dt = poisoned_gpu({n, 5, 8}, into), dp = poisoned_gpu({n, 6}, into);
    cache.read(order, dl, dt, dp, options);
    for (const auto& [host, device] : {std::pair{hl, dl}, std::pair{ht, dt}, std::pair{hp, dp}}) {
      const Tensor back = device.to(Device::CPU);
      EXPECT_EQ(std::memcmp(back.raw(), host.raw(), host.nbytes()), 0) << "read into " << dtype_name(into);
    }
  }
}

}  // namespace
}  // namespace forge::gpu_test
