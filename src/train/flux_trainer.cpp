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
#include "model/flux_parameters.h"
#include "ops/adamw.h"
#include "ops/elementwise.h"
#include "kernels/gemm_tuning_cache.h"
#include "ops/flow_matching.h"
#include "ops/matmul.h"
#include "ops/patchify.h"
#include "ops/random_normal.h"
#include "optim/optimizer.h"
#include "train/flow_timesteps.h"
#include "train/flux_cache_batches.h"
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
enum Stream : uint64_t { kLatents = 1, kText, kPooled, kNoise, kTimesteps, kData };

// The first numel(shape) elements of a flat buffer, as `shape`.
Tensor sized(const Tensor& flat, const Shape& shape) { return flat.narrow(0, shape_numel(shape)).view(shape); }

// The latent cache a run trains on (flux.data_path), its shapes checked against the model.
struct CacheSource {
  FluxLatentCache cache;
  FluxCacheBatches batches;
  CacheSource(const ExperimentConfig& c, const FluxConfig& mc)
      : cache(c.flux.data_path),
        batches(cache.manifest(), c.training.local_batch_size, derive_seed(c.training.seed, kData),
                "flux.data_path " + c.flux.data_path) {
    const FluxCacheManifest& m = cache.manifest();
    FORGE_CHECK(m.latent_channels * 4 == mc.in_channels && m.context_dim == mc.context_dim &&
                    m.pooled_dim == mc.pooled_dim,
                "flux.data_path {}: the cache holds {}-channel latents, text features of {} and pooled vectors of {}; "
                "{} takes {}-channel latents (2x2 patches of {} features), text features of {} and pooled vectors "
                "of {}",
                c.flux.data_path, m.latent_channels, m.context_dim, m.pooled_dim, c.flux.model, mc.in_channels / 4,
                mc.in_channels, mc.context_dim, mc.pooled_dim);
    for (const FluxCacheShard& shard : m.shards)
      FORGE_CHECK(shard.latent_height % 2 == 0 && shard.latent_width % 2 == 0,
                  "flux.data_path {}: {} holds {}x{} latents; the 2x2 patches need even sides", c.flux.data_path,
                  shard.file, shard.latent_width, shard.latent_height);
  }
};

// The micro-batch shape the model is planned for: the configured one, or with a cache its
// text length and its largest latent grid.
FluxShape planned_shape(const FluxShape& configured, const CacheSource* source) {
  if (!source) return configured;
  FluxShape s = configured;
  s.text_tokens = source->cache.manifest().text_tokens;
  s.grid_h = s.grid_w = 0;
  for (const FluxCacheShard& shard : source->cache.manifest().shards)
    if (shard.latent_height * shard.latent_width / 4 > s.image_tokens()) {
      s.grid_h = shard.latent_height / 2;
      s.grid_w = shard.latent_width / 2;
    }
  return s;
}

}  // namespace

struct FluxTrainer::State {
  FluxConfig model_config;
  std::unique_ptr<CacheSource> source;  // null: synthetic micro-batches
  FluxShape shape;                      // planned for: the largest micro-batch
  Device device;
  DType dtype;
  FluxParameters master, compute, grads, m, v;
  FluxTransformer model;
  // Flat buffers of the largest micro-batch; sized() views them per micro-batch.
  Tensor x0, noise, noisy, target, latents, pred, dpred;
  Tensor text, pooled, t, loss;
  FlowTimestepSampling sampling;

  State(const ExperimentConfig& c, const FluxConfig& mc, const FluxShape& sh, Device dev)
      : model_config(mc), source(c.flux.data_path.empty() ? nullptr : std::make_unique<CacheSource>(c, mc)),
        shape(planned_shape(sh, source.get())), device(dev), dtype(dev == Device::CUDA ? DType::BF16 : DType::F32),
        master(mc, dev, DType::F32), compute(mc, dev, dtype), grads(mc, dev, DType::F32), m(mc, dev, DType::F32),
        v(mc, dev, DType::F32),
        model(mc, shape, dev, activation_checkpoint_from_name(c.activation_checkpoint.mode)),
        sampling(timestep_sampling(c.flux)) {
    const int64_t most = shape.batch * shape.image_tokens() * mc.in_channels;
    for (Tensor* x : {&x0, &noise, &noisy, &target, &latents, &pred, &dpred}) *x = Tensor::empty({most}, dtype, dev);
    text = Tensor::empty({shape.batch, shape.text_tokens, mc.context_dim}, dtype, dev);
    pooled = Tensor::empty({shape.batch, mc.pooled_dim}, dtype, dev);
    t = Tensor::empty({shape.batch}, DType::F32, dev);
    loss = Tensor::empty({1}, DType::F32, dev);
    master.initialize(c.training.seed);
    if (!c.flux.initial_load_path.empty()) {  // NOTE [FLUX weight files]
      FluxParameters host(mc);
      load_flux_weights(c.flux.initial_load_path, host);
      master.assign_from(host);
      log_info("FLUX weights from {}", c.flux.initial_load_path);
    }
    compute.assign_from(master);
    m.zero();
    v.zero();
    grads.zero();  // once: the gaps between its tensors stay 0; the steps write the tensors
  }
};

FluxTrainer::FluxTrainer(const ExperimentConfig& config) : config_(config) {
  const Device device = config.training.device == "cuda" ? Device::CUDA : Device::CPU;
  const TrainingConfig& t = config.training;
  set_gemm_tuning(t.gemm_tuning, t.gemm_tuning ? gemm_tuning_cache_dir(t.gemm_tuning_cache) : "");
  state_ = std::make_unique<State>(config_, flux_model_config(config.flux), flux_micro_batch_shape(config), device);
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
  if (log && s.source) {
    const FluxCacheManifest& m = s.source->cache.manifest();
    log_info("FLUX data: {} ({} samples in {} shards, {} latents, {} text tokens): {} micro-batches of {} per epoch",
             s.source->cache.folder(), m.samples, m.shards.size(), m.autoencoder, m.text_tokens,
             s.source->batches.batches_per_epoch(), s.shape.batch);
  }
  for (int64_t step = 0; step < tc.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    reset_op_profile();
    s.loss.fill_zero();
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      // Micro-batch k of the run holds its samples k B + j; their noise (and synthetic
      // inputs) start at that offset of each stream, whatever their latent grid.
      const int64_t k = step * accumulation + micro;
      const uint64_t first = static_cast<uint64_t>(k * s.shape.batch);
      FluxShape shape = s.shape;
      FluxCacheBatch batch;
      if (s.source) {  // NOTE [FLUX cache batches]
        batch = s.source->batches.at(k);
        shape.grid_h = batch.latent_height / 2;
        shape.grid_w = batch.latent_width / 2;
      }
      s.model.reshape(shape);
      const Shape tokens{shape.batch, shape.image_tokens(), s.model_config.in_channels};
      const Tensor x0 = sized(s.x0, tokens), noise = sized(s.noise, tokens), noisy = sized(s.noisy, tokens),
                   target = sized(s.target, tokens), pred = sized(s.pred, tokens), dpred = sized(s.dpred, tokens);
      if (s.source) {
        const Tensor latents = sized(s.latents, {shape.batch, s.model_config.in_channels / 4, batch.latent_height,
                                                 batch.latent_width});
        s.source->cache.read(batch.samples, latents, s.text, s.pooled);
        patchify(x0, latents, 2);
      } else {
        random_normal(x0, derive_seed(seed, kLatents), first * static_cast<uint64_t>(per_sample_latent));
        random_normal(s.text, derive_seed(seed, kText), first * static_cast<uint64_t>(per_sample_text));
        random_normal(s.pooled, derive_seed(seed, kPooled), first * static_cast<uint64_t>(s.model_config.pooled_dim));
      }
      random_normal(noise, derive_seed(seed, kNoise), first * static_cast<uint64_t>(per_sample_latent));
      const std::vector<float> times = sample_flow_timesteps(s.sampling, derive_seed(seed, kTimesteps), step, micro,
                                                             shape.batch, shape.image_tokens());
      s.t.copy_from(Tensor::wrap(const_cast<float*>(times.data()), {shape.batch}, DType::F32));
      flow_matching_pair(noisy, target, x0, noise, s.t);
      FluxInputs inputs{noisy, s.text, s.pooled, times, guidance};
      s.model.forward(inputs, s.compute, pred);
      mse_loss(s.loss, dpred, pred, target, 1.0f / static_cast<float>(accumulation));
      s.model.backward(dpred, s.compute, s.grads, micro == 0);  // the first writes fresh gradients
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
  }
  if (config_.flux.last_save_in_diffusers) {
    const std::string dir = expand_run_dir(config_.logging.run_dir, config_.flux.model);
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
