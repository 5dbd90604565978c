// FLUX checkpoints on the GPU (NOTE [FLUX checkpoints]): the master weights and AdamW moments
// live in GPU memory; a save streams them to the file through the staging buffer (device to
// host copies) and a load streams them back. The file a GPU state makes is byte for byte the
// one the same state makes from host memory, and loading it onto the GPU gives the bits
// back. A FLUX run on CUDA stopped after 3 steps and resumed (synchronous and asynchronous
// saves) ends where the uninterrupted 6-step run does: bit for bit when two uninterrupted
// runs agree bit for bit (deterministic kernels), else within their own run-to-run spread.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "cli/config.h"
#include "../cpu/test_data_temp_dir.h"
#include "gpu_testing.h"
#include "model/flux_parameters.h"
#include "train/flux_checkpoint.h"
#include "train/flux_trainer.h"

namespace forge {
namespace {

using gpu_test::file_bytes;

TrainingState state_at(int64_t step) {
  TrainingState s;
  s.step = step;
  s.data_position = step;
  s.optimizer_step = step;
  return s;
}

TEST(GpuFluxCheckpoint, GpuStateSavesAndLoadsBitExact) {
  TempDir tmp;
  const FluxConfig config = flux_preset("flux-debug");
  FluxParameters host_master(config), host_m(config), host_v(config);
  host_master.initialize(gpu_test::seed_for_current_test());
  Rng rng(gpu_test::seed_for_current_test() + 1);
  for (FluxParameters* p : {&host_m, &host_v})
    for (const Tensor& t : p->tensors())
      for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal());
  FluxParameters gpu_master(config, Device::CUDA), gpu_m(config, Device::CUDA), gpu_v(config, Device::CUDA);
  gpu_master.assign_from(host_master);
  gpu_m.assign_from(host_m);
  gpu_v.assign_from(host_v);

  // A 4 KiB buffer: many chunks per tensor, both halves in use.
  const std::string from_host =
      save_flux_checkpoint(tmp.file("host"), "", state_at(1), host_master, host_m, host_v, 0, size_t{1} << 12);
  const std::string from_gpu =
      save_flux_checkpoint(tmp.file("gpu"), "", state_at(1), gpu_master, gpu_m, gpu_v, 0, size_t{1} << 12);
  EXPECT_TRUE(file_bytes(from_gpu + "/rank-0.bin") == file_bytes(from_host + "/rank-0.bin"));

  FluxParameters loaded_master(config, Device::CUDA), loaded_m(config, Device::CUDA), loaded_v(config, Device::CUDA);
  const Checkpoint ck = open_checkpoint(from_gpu);
  check_flux_checkpoint_model(ck, config, true);
  read_flux_checkpoint(ck, loaded_master, &loaded_m, &loaded_v, size_t{1} << 12);
  for (const auto& [loaded, expected] : {std::pair{&loaded_master, &host_master}, {&loaded_m, &host_m},
                                         {&loaded_v, &host_v}}) {
    const Tensor back = loaded->flat().to(Device::CPU);
    EXPECT_EQ(std::memcmp(back.data<float>(), expected->flat().data<float>(), back.nbytes()), 0);
  }
}

ExperimentConfig flux_run(const std::string& run_dir, int64_t steps, const std::string& async_mode) {
  return load_experiment("", {{"flux.model", "flux-debug"},
                              {"flux.resolution", "64"},
                              {"flux.text_tokens", "8"},
                              {"training.device", "cuda"},
                              {"precision.compute_dtype", "bf16"},
                              {"training.local_batch_size", "2"},
                              {"training.steps", std::to_string(steps)},
                              {"lr_scheduler.warmup_steps", "2"},
                              {"lr_scheduler.decay_style", "constant"},
                              {"eval.interval", "0"},
                              {"logging.run_dir", run_dir},
                              {"checkpoint.enable", "true"},
                              {"checkpoint.interval", "3"},
                              {"checkpoint.async_mode", async_mode}});
}

std::string final_state(const std::string& run_dir, int64_t step) {
  return file_bytes(run_dir + "/checkpoints/step-" + std::to_string(step) + "/rank-0.bin");
}

// Largest |a - b| / max |b| over the fp32 values of two shard files.
double relative_difference(const std::string& a, const std::string& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i + 4 <= std::min(a.size(), b.size()); i += 4) {
    float x = 0, y = 0;
    std::memcpy(&x, a.data() + i, 4);
    std::memcpy(&y, b.data() + i, 4);
    diff = std::max(diff, static_cast<double>(std::fabs(x - y)));
    scale = std::max(scale, static_cast<double>(std::fabs(y)));
  }
  return diff / scale;
}

TEST(GpuFluxCheckpoint, ResumedRunEndsWhereTheUninterruptedOneDoes) {
  TempDir tmp;
  FluxTrainer(flux_run(tmp.file("full"), 6, "disabled")).run(false);
  FluxTrainer(flux_run(tmp.file("full-again"), 6, "disabled")).run(false);
  const std::string full = final_state(tmp.file("full"), 6);
  const bool deterministic = full == final_state(tmp.file("full-again"), 6);
  const double spread = relative_difference(final_state(tmp.file("full-again"), 6), full);
  for (const std::string async_mode : {"disabled", "async"}) {
    const std::string run_dir = tmp.file("resumed-" + async_mode);
    FluxTrainer(flux_run(run_dir, 3, async_mode)).run(false);
    const FluxTrainResult rest = FluxTrainer(flux_run(run_dir, 6, async_mode)).run(false);
    EXPECT_EQ(rest.losses.size(), 3u) << async_mode;
    if (deterministic) EXPECT_TRUE(final_state(run_dir, 6) == full) << async_mode;
    else EXPECT_LE(relative_difference(final_state(run_dir, 6), full), std::max(4 * spread, 1e-6)) << async_mode;
  }
  std::printf("uninterrupted runs on the GPU agree %s (spread %.3g)\n", deterministic ? "bit for bit" : "not bit for bit",
              spread);
}

}  // namespace
}  // namespace forge
