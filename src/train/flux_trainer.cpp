// FLUX training on one device; see flux_trainer.h.
#include "train/flux_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "ckpt/flux_weights.h"
#include "ckpt/hf_export.h"
#include "core/device.h"
#include "core/log.h"
#include "core/op_profile.h"
#include "core/rng.h"
#include "core/stop_signal.h"
#include "model/flux_parameters.h"
#include "ops/adamw.h"
#include "ops/elementwise.h"
#include "kernels/gemm_tuning_cache.h"
#include "ops/flow_matching.h"
#include "ops/matmul.h"
#include "ops/random_normal.h"
#include "optim/optimizer.h"
#include "train/flow_timesteps.h"
#include "train/run_dir.h"

namespace forge {

FluxConfig flux_model_config(const FluxRunConfig& run) {
  FluxConfig c = flux_preset(run.model);
  if (run.num_double_blocks >= 0) c.num_double_blocks = run.num_double_blocks;
  if (run.num_single_blocks >= 0) c.num_single_blocks = run.num_single_blocks;
  c.validate("flux." + run.model);
  return c;
}

FluxShape flux_micro_batch_shape(const ExperimentConfig& config) {
  FluxShape s;
  s.batch = config.training.local_batch_size;
  s.text_tokens = config.flux.text_tokens;
  s.grid_h = s.grid_w = config.flux.resolution / 16;
  return s;
}

namespace {

FlowTimestepSampling timestep_sampling(const FluxRunConfig& f) {
  FlowTimestepSampling s;
  s.weighting = f.timestep_sampling;
  s.logit_mean = f.logit_mean;
  s.logit_std = f.logit_std;
  s.shift = f.timestep_shift;
  s.shift_value = f.shift;
  s.validate();
  return s;
}

// Streams of the run's seed, one per purpose (derive_seed).
enum Stream : uint64_t { kLatents = 1, kText, kPooled, kNoise, kTimesteps };

}  // namespace

struct FluxTrainer::State {
  FluxConfig model_config;
  FluxShape shape;
  Device device;
  DType dtype;
  FluxParameters master, compute, grads, m, v;
  FluxTransformer model;
  Tensor x0, noise, noisy, target, text, pooled, t, pred, dpred, loss;
  FlowTimestepSampling sampling;

  State(const ExperimentConfig& c, const FluxConfig& mc, const FluxShape& sh, Device dev)
      : model_config(mc), shape(sh), device(dev), dtype(dev == Device::CUDA ? DType::BF16 : DType::F32),
        master(mc, dev, DType::F32), compute(mc, dev, dtype), grads(mc, dev, DType::F32), m(mc, dev, DType::F32),
        v(mc, dev, DType::F32),
        model(mc, sh, dev, activation_checkpoint_from_name(c.activation_checkpoint.mode)),
        sampling(timestep_sampling(c.flux)) {
    const Shape tokens{sh.batch, sh.image_tokens(), mc.in_channels};
    for (Tensor* x : {&x0, &noise, &noisy, &target, &pred, &dpred}) *x = Tensor::empty(tokens, dtype, dev);
    text = Tensor::empty({sh.batch, sh.text_tokens, mc.context_dim}, dtype, dev);
    pooled = Tensor::empty({sh.batch, mc.pooled_dim}, dtype, dev);
    t = Tensor::empty({sh.batch}, DType::F32, dev);
    loss = Tensor::empty({1}, DType::F32, dev);
    master.initialize(c.training.seed);  // FluxCheckpoints::start then loads what the run starts from
    m.zero();
    v.zero();
    grads.zero();  // once: the gaps between its tensors stay 0; the steps write the tensors
  }
};

FluxTrainer::FluxTrainer(const ExperimentConfig& config, std::string resolved_yaml) : config_(config) {
  const Device device = config.training.device == "cuda" ? Device::CUDA : Device::CPU;
  const TrainingConfig& t = config.training;
  set_gemm_tuning(t.gemm_tuning, t.gemm_tuning ? gemm_tuning_cache_dir(t.gemm_tuning_cache) : "");
  state_ = std::make_unique<State>(config_, flux_model_config(config.flux), flux_micro_batch_shape(config), device);
  State& s = *state_;
  checkpoints_ = std::make_unique<FluxCheckpoints>(config_, std::move(resolved_yaml), s.model_config);
  start_step_ = checkpoints_->start(s.master, s.m, s.v);  // NOTE [FLUX checkpoints]
  s.compute.assign_from(s.master);  // NOTE [Exact FLUX resume]: cast as the optimizer casts
}

FluxTrainer::~FluxTrainer() = default;

FluxTrainResult FluxTrainer::run(bool log) {
  State& s = *state_;
  const TrainingConfig& tc = config_.training;
  const int64_t accumulation = std::max<int64_t>(1, tc.gradient_accumulation_steps);
  const uint64_t seed = tc.seed;
  const int64_t per_sample_latent = s.shape.image_tokens() * s.model_config.in_channels;
  const int64_t per_sample_text = s.shape.text_tokens * s.model_config.context_dim;
  FluxTrainResult result;
  std::vector<float> guidance(static_cast<size_t>(s.shape.batch), static_cast<float>(config_.flux.guidance));
  if (!s.model_config.guidance_embeds) guidance.clear();
  const double images_per_step = static_cast<double>(s.shape.batch * accumulation);
  set_op_profiling(config_.logging.profile_ops);
  for (int64_t step = start_step_; step < tc.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    reset_op_profile();
    s.loss.fill_zero();
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      // Sample k of the run is micro-batch (step, micro)'s sample j: k = (step A + micro) B + j.
      const uint64_t first = static_cast<uint64_t>((step * accumulation + micro) * s.shape.batch);
      random_normal(s.x0, derive_seed(seed, kLatents), first * static_cast<uint64_t>(per_sample_latent));
      random_normal(s.noise, derive_seed(seed, kNoise), first * static_cast<uint64_t>(per_sample_latent));
      random_normal(s.text, derive_seed(seed, kText), first * static_cast<uint64_t>(per_sample_text));
      random_normal(s.pooled, derive_seed(seed, kPooled), first * static_cast<uint64_t>(s.model_config.pooled_dim));
      const std::vector<float> times = sample_flow_timesteps(s.sampling, derive_seed(seed, kTimesteps), step, micro,
                                                             s.shape.batch, s.shape.image_tokens());
      s.t.copy_from(Tensor::wrap(const_cast<float*>(times.data()), {s.shape.batch}, DType::F32));
      flow_matching_pair(s.noisy, s.target, s.x0, s.noise, s.t);
      FluxInputs inputs{s.noisy, s.text, s.pooled, times, guidance};
      s.model.forward(inputs, s.compute, s.pred);
      mse_loss(s.loss, s.dpred, s.pred, s.target, 1.0f / static_cast<float>(accumulation));
      s.model.backward(s.dpred, s.compute, s.grads, micro == 0);  // the first writes fresh gradients
    }
    const double norm = global_grad_norm({s.grads.flat()});
    const float coefficient = clip_coefficient(norm, tc.max_norm);
    FORGE_CHECK(std::isfinite(norm), "FLUX step {}: the gradient norm is not finite ({})", step + 1, norm);
    AdamWHyper h;
    h.lr = lr_at(config_.optimizer, config_.lr_scheduler, step, tc.steps);
    h.beta1 = config_.optimizer.beta1;
    h.beta2 = config_.optimizer.beta2;
    h.eps = config_.optimizer.eps;
    h.step = step + 1;
    h.grad_scale = coefficient;
    // Two calls, with and without weight decay (NOTE [FLUX parameter regions]).
    for (const bool decayed : {true, false}) {
      auto region = [&](const FluxParameters& p) { return decayed ? p.decayed() : p.not_decayed(); };
      h.weight_decay = decayed ? config_.optimizer.weight_decay : 0.0;
      adamw_update(region(s.master), region(s.grads), region(s.m), region(s.v), h,
                   s.device == Device::CUDA ? region(s.compute) : Tensor());
    }
    if (s.device == Device::CPU) s.compute.assign_from(s.master);
    const Tensor host_loss = s.loss.to(Device::CPU);  // waits for the step's work
    const double loss = host_loss.data<float>()[0] / static_cast<double>(accumulation);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.step_seconds.push_back(seconds);
    result.losses.push_back(loss);
    FORGE_CHECK(std::isfinite(loss), "FLUX step {}: the loss is not finite ({})", step + 1, loss);
    if (log && ((step + 1) % config_.logging.log_interval == 0 || step + 1 == tc.steps))
      log_info("step {:>5} | loss {:.4f} | grad norm {:.3f} | lr {:.3e} | {:.2f} images/s | step {:.1f} ms", step + 1,
               loss, norm, h.lr, images_per_step / seconds, seconds * 1e3);
    const int signal = stop_signal();  // NOTE [Stop signals]
    checkpoints_->after_step(step + 1, signal != 0, s.master, s.m, s.v);
    if (signal != 0) {
      if (log) log_info("stopped by signal {} after step {}", signal, step + 1);
      result.stopped = true;
      break;
    }
  }
  checkpoints_->finish();  // an asynchronous save in flight
  if (config_.flux.last_save_in_diffusers && !result.stopped) {
    const std::string dir = checkpoints_->run_dir();
    create_run_dir(dir);
    FluxParameters host(s.model_config);
    host.assign_from(s.master);
    save_flux_weights(dir + "/diffusers", host, FluxWeightLayout::Diffusers,
                      export_safetensors_dtype(config_.checkpoint.export_dtype));
    if (log) log_info("exported the FLUX weights to {}/diffusers ({})", dir, config_.checkpoint.export_dtype);
  }
  if (log && config_.logging.profile_ops) {  // NOTE [Op profiling]: the last step's time per op
    std::vector<std::pair<double, std::string>> ops;
    for (const auto& [name, seconds] : op_profile_seconds_by_op()) ops.emplace_back(seconds, name);
    std::sort(ops.rbegin(), ops.rend());
    for (const auto& [seconds, name] : ops) log_info("  {:9.3f} ms  {}", seconds * 1e3, name);
  }
  return result;
}

}  // namespace forge
