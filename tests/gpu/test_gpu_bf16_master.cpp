// bf16 master weights on the GPU (NOTE [bf16 master weights] in optim/optimizer.h): the
// CUDA AdamW of a bf16 param against the CPU reference on fresh random data (the same
// Philox bits, so the same rounding wherever the fp32 updates agree; the aligned
// four-at-a-time path, the odd tails and an offset that is not a multiple of four), with
// bf16 moments against fp32 ones, and a FLUX run with bf16 weights and moments against the
// fp32-master run, resumed from its checkpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <unistd.h>

#include "cli/config.h"
#include "core/bf16.h"
#include "../cpu/test_data_temp_dir.h"
#include "gpu_testing.h"
#include "ops/adamw.h"
#include "train/flux_trainer.h"

namespace forge {
namespace {

using gpu_test::file_bytes;
using gpu_test::random_bf16_values;
using gpu_test::random_f32;
using gpu_test::relative_l2;
using gpu_test::seed_for_current_test;
using gpu_test::to_cpu_f32;

Tensor bf16_cpu(const Tensor& f32) {
  Tensor t = Tensor::empty(f32.shape(), DType::BF16);
  cast(t, f32);
  return t;
}

TEST(GpuAdamWBf16Master, MatchesCpuReference) {
  Rng rng(seed_for_current_test());
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
    for (int64_t offset : {int64_t{0}, int64_t{3}}) {
      Tensor p = bf16_cpu(random_bf16_values({n}, rng)), m = Tensor::zeros({n}), v = Tensor::zeros({n});
      Tensor pg = p.to(Device::CUDA), mg = m.to(Device::CUDA), vg = v.to(Device::CUDA);
      for (int64_t step = 1; step <= 3; ++step) {
        Tensor g = random_f32({n}, rng);
        AdamWHyper h{1e-2, 0.9, 0.95, 1e-8, 0.1, step, step == 2 ? 0.37f : 1.0f};
        h.rounding_seed = 1234;
        h.rounding_offset = offset;
        adamw_update(p, g, m, v, h);
        adamw_update(pg, g.to(Device::CUDA), mg, vg, h);
      }
      // Both sides round with the same bits: a weight differs only where the fp32 updates
      // differ in their last bit and the threshold falls between them (at most an ulp).
      const Tensor back = pg.to(Device::CPU);
      int64_t differ = 0;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t a = back.data<BFloat16>()[i].bits, b = p.data<BFloat16>()[i].bits;
        differ += a != b;
        EXPECT_LE(std::abs(static_cast<int>(a) - static_cast<int>(b)), 1) << "n " << n << " element " << i;
      }
      EXPECT_LE(differ, std::max<int64_t>(1, n / 10000)) << "n " << n << " offset " << offset;
      EXPECT_LT(relative_l2(to_cpu_f32(mg), m), 1e-6);
      EXPECT_LT(relative_l2(to_cpu_f32(vg), v), 1e-6);
    }
  }
}

TEST(GpuAdamWBf16Master, Bf16MomentsTrackFp32Moments) {
  Rng rng(seed_for_current_test());
  const int64_t n = 100003;
  Tensor p = bf16_cpu(random_bf16_values({n}, rng)), m = Tensor::zeros({n}), v = Tensor::zeros({n});
  Tensor pg = p.to(Device::CUDA), mg = Tensor::zeros({n}, DType::BF16, Device::CUDA),
         vg = Tensor::zeros({n}, DType::BF16, Device::CUDA);
  for (int64_t step = 1; step <= 5; ++step) {
    Tensor g = random_f32({n}, rng);
    AdamWHyper h{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
    h.rounding_seed = 77;
    adamw_update(p, g, m, v, h);
    adamw_update(pg, g.to(Device::CUDA), mg, vg, h);
  }
  Tensor pf = Tensor::empty({n});
  cast(pf, p);
  EXPECT_LT(relative_l2(to_cpu_f32(pg), pf), 1e-3);
  EXPECT_LT(relative_l2(to_cpu_f32(mg), m), 8e-3);
  EXPECT_LT(relative_l2(to_cpu_f32(vg), v), 8e-3);
}

ExperimentConfig flux_run(const std::string& run_dir, int64_t steps, const std::string& dtype) {
  return load_experiment("", {{"flux.model", "flux-debug"},
                              {"flux.resolution", "64"},
                              {"flux.text_tokens", "8"},
                              {"training.device", "cuda"},
                              {"precision.compute_dtype", "bf16"},
                              {"training.local_batch_size", "2"},
                              {"training.steps", std::to_string(steps)},
                              {"optimizer.lr", "1e-3"},
                              {"optimizer.master_dtype", dtype},
                              {"optimizer.state_dtype", dtype},
                              {"lr_scheduler.warmup_steps", "2"},
                              {"lr_scheduler.decay_style", "constant"},
                              {"eval.interval", "0"},
                              {"logging.run_dir", run_dir},
                              {"checkpoint.enable", "true"},
                              {"checkpoint.interval", "3"}});
}

TEST(GpuFluxBf16Master, TracksFp32MastersAndResumes) {
  TempDir tmp;
  const FluxTrainResult fp32 = FluxTrainer(flux_run(tmp.file("fp32"), 6, "fp32")).run(false);
  const FluxTrainResult bf16 = FluxTrainer(flux_run(tmp.file("bf16"), 6, "bf16")).run(false);
  ASSERT_EQ(bf16.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    std::printf("step %zu: loss %.6f with fp32 masters, %.6f with bf16 weights and moments\n", i + 1,
                fp32.losses[i], bf16.losses[i]);
    EXPECT_NEAR(bf16.losses[i], fp32.losses[i], 2e-2 * fp32.losses[i]) << "step " << i + 1;
  }
  const FluxTrainResult again = FluxTrainer(flux_run(tmp.file("bf16-again"), 6, "bf16")).run(false);
  const bool deterministic = again.losses == bf16.losses;
  const std::string resumed = tmp.file("resumed");
  FluxTrainer(flux_run(resumed, 3, "bf16")).run(false);
  const FluxTrainResult rest = FluxTrainer(flux_run(resumed, 6, "bf16")).run(false);
  ASSERT_EQ(rest.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    if (deterministic)
      EXPECT_EQ(rest.losses[i], bf16.losses[i + 3]) << "step " << i + 4;
    else
      EXPECT_NEAR(rest.losses[i], bf16.losses[i + 3], 1e-3 * bf16.losses[i + 3]) << "step " << i + 4;
  }
  if (deterministic)
    EXPECT_TRUE(file_bytes(resumed + "/checkpoints/step-6/rank-0.bin") ==
                file_bytes(tmp.file("bf16") + "/checkpoints/step-6/rank-0.bin"));
  std::printf("bf16-weight runs on the GPU %s\n", deterministic ? "repeat bit for bit" : "do not repeat bit for bit");
}

}  // namespace
}  // namespace forge
