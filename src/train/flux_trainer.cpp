// FLUX training on one device; see flux_trainer.h.
#include "train/flux_trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "ckpt/flux_weights.h"
#include "ckpt/hf_export.h"
#include "core/bf16.h"
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
enum Stream : uint64_t {
  kLatents = 1,
  kText,
  kPooled,
  kNoise,
  kTimesteps,
  kData,
  kEvalNoise,
  kCaptionDropout,  // NOTE [FLUX caption dropout]
  kPosterior        // NOTE [FLUX posterior latents]
};

// The first numel(shape) elements of a flat buffer, as `shape`.
Tensor sized(const Tensor& flat, const Shape& shape) { return flat.narrow(0, shape_numel(shape)).view(shape); }

// A tensor's values as host floats.
std::vector<float> host_values(const Tensor& t) {
  const Tensor h = t.to(Device::CPU);
  std::vector<float> out(static_cast<size_t>(h.numel()));
  if (h.dtype() == DType::BF16)
    for (size_t i = 0; i < out.size(); ++i) out[i] = to_float(h.data<BFloat16>()[i]);
  else
    std::copy_n(h.data<float>(), out.size(), out.begin());
  return out;
}

// Checks that a latent cache's tensors fit the model; `key` names the config key.
void check_cache_fits(const FluxLatentCache& cache, const FluxConfig& mc, const std::string& key) {
  const FluxCacheManifest& m = cache.manifest();
  FORGE_CHECK(m.latent_channels * 4 == mc.in_channels && m.context_dim == mc.context_dim && m.pooled_dim == mc.pooled_dim,
              "{} {}: the cache holds {}-channel latents, text features of {} and pooled vectors of {}; {} takes "
              "{}-channel latents (2x2 patches of {} features), text features of {} and pooled vectors of {}",
              key, cache.folder(), m.latent_channels, m.context_dim, m.pooled_dim, mc.name, mc.in_channels / 4,
              mc.in_channels, mc.context_dim, mc.pooled_dim);
  for (const FluxCacheShard& shard : m.shards)
    FORGE_CHECK(shard.latent_height % 2 == 0 && shard.latent_width % 2 == 0,
                "{} {}: {} holds {}x{} latents; the 2x2 patches need even sides", key, cache.folder(), shard.file,
                shard.latent_width, shard.latent_height);
}

// The latent cache a run trains on (flux.data_path), its shapes checked against the model.
struct CacheSource {
  FluxLatentCache cache;
  FluxCacheBatches batches;
  CacheSource(const ExperimentConfig& c, const FluxConfig& mc)
      : cache(c.flux.data_path),
        batches(cache.manifest(), c.training.local_batch_size, derive_seed(c.training.seed, kData),
                "flux.data_path " + c.flux.data_path) {
    check_cache_fits(cache, mc, "flux.data_path");
    if (c.flux.caption_dropout_prob > 0 && !cache.manifest().has_empty_prompt())
      FORGE_FAIL(
          "flux.caption_dropout_prob {}: the latent cache {} (flux.data_path) holds no empty caption's encodings "
          "(cache.json has no \"empty_prompt\"): prepare it again with forge prep --images (or "
          "scripts/flux_cache_from_diffusers.py), or set flux.caption_dropout_prob 0",
          c.flux.caption_dropout_prob, c.flux.data_path);
  }
};

// The most elements a micro-batch of `batch` samples of the cache needs: {latent, text}.
std::pair<int64_t, int64_t> cache_elements(const FluxLatentCache& cache, int64_t batch) {
  const FluxCacheManifest& m = cache.manifest();
  int64_t latent = 0;
  for (const FluxCacheShard& shard : m.shards) latent = std::max(latent, shard.latent_height * shard.latent_width);
  return {batch * latent * m.latent_channels, batch * m.text_tokens * m.context_dim};
}

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
  std::unique_ptr<FluxLatentCache> eval_cache;  // flux.eval_data_path
  FluxShape shape;                      // planned for: the largest micro-batch
  Device device;
  DType dtype;
  FluxParameters master, compute, grads, m, v;
  FluxTransformer model;
  // Flat buffers of the largest micro-batch; sized() views them per micro-batch.
  Tensor x0, noise, noisy, target, latents, pred, dpred, text;
  Tensor pooled, t, loss;
  FlowTimestepSampling sampling;

  // NOTE [FLUX validation loss], after `step` training steps.
  FluxEvalResult evaluate(const ExperimentConfig& c, int64_t step);

  State(const ExperimentConfig& c, const FluxConfig& mc, const FluxShape& sh, Device dev)
      : model_config(mc), source(c.flux.data_path.empty() ? nullptr : std::make_unique<CacheSource>(c, mc)),
        shape(planned_shape(sh, source.get())), device(dev), dtype(dev == Device::CUDA ? DType::BF16 : DType::F32),
        master(mc, dev, DType::F32), compute(mc, dev, dtype), grads(mc, dev, DType::F32), m(mc, dev, DType::F32),
        v(mc, dev, DType::F32),
        model(mc, shape, dev, activation_checkpoint_from_name(c.activation_checkpoint.mode)),
        sampling(timestep_sampling(c.flux)) {
    if (!c.flux.eval_data_path.empty()) {
      eval_cache = std::make_unique<FluxLatentCache>(c.flux.eval_data_path);
      check_cache_fits(*eval_cache, mc, "flux.eval_data_path");
    }
    int64_t most = shape.batch * shape.image_tokens() * mc.in_channels;
    int64_t most_text = shape.batch * shape.text_tokens * mc.context_dim;
    if (eval_cache) {
      const auto [latent, text_elements] = cache_elements(*eval_cache, shape.batch);
      most = std::max(most, latent);
      most_text = std::max(most_text, text_elements);
    }
    for (Tensor* x : {&x0, &noise, &noisy, &target, &latents, &pred, &dpred}) *x = Tensor::empty({most}, dtype, dev);
    text = Tensor::empty({most_text}, dtype, dev);
    pooled = Tensor::empty({shape.batch, mc.pooled_dim}, dtype, dev);
    t = Tensor::empty({shape.batch}, DType::F32, dev);
    loss = Tensor::empty({1}, DType::F32, dev);
    master.initialize(c.training.seed, parse_flux_weight_init(c.flux.weight_init, "flux.weight_init"));  // FluxCheckpoints::start then loads what the run starts from
    m.zero();
    v.zero();
    grads.zero();  // once: the gaps between its tensors stay 0; the steps write the tensors
  }
};

FluxEvalResult FluxTrainer::State::evaluate(const ExperimentConfig& c, int64_t step) {
  constexpr int kTimes = 8;
  const FluxCacheManifest& m = eval_cache->manifest();
  const int64_t batch = shape.batch, limit = std::min(m.samples, c.eval.steps * batch);
  const uint64_t noise_seed = derive_seed(c.training.seed, kEvalNoise);
  std::array<double, kTimes> sum{};
  std::array<int64_t, kTimes> count{};
  int64_t first = 0;  // of the shard
  for (const FluxCacheShard& shard : m.shards) {
    for (int64_t row = 0; row < shard.samples && first + row < limit; row += batch) {
      const int64_t n = std::min({batch, shard.samples - row, limit - first - row});
      const FluxShape sh{n, m.text_tokens, shard.latent_height / 2, shard.latent_width / 2};
      model.reshape(sh);
      const Shape tokens{n, sh.image_tokens(), model_config.in_channels};
      const Tensor x0_n = sized(x0, tokens), noise_n = sized(noise, tokens), noisy_n = sized(noisy, tokens),
                   target_n = sized(target, tokens), pred_n = sized(pred, tokens),
                   text_n = sized(text, {n, m.text_tokens, model_config.context_dim}),
                   latents_n = sized(latents, {n, m.latent_channels, shard.latent_height, shard.latent_width}),
                   pooled_n = pooled.narrow(0, n), t_n = t.narrow(0, n);
      std::vector<int64_t> samples(static_cast<size_t>(n));
      std::iota(samples.begin(), samples.end(), first + row);
      eval_cache->read(samples, latents_n, text_n, pooled_n);
      patchify(x0_n, latents_n, 2);
      std::vector<float> times(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) {
        const int64_t i = samples[static_cast<size_t>(j)];
        times[static_cast<size_t>(j)] = static_cast<float>(i % kTimes) / kTimes;
        random_normal(noise_n.narrow(j, j + 1), noise_seed, static_cast<uint64_t>(i) << 32);  // per sample
      }
      t_n.copy_from(Tensor::wrap(times.data(), {n}, DType::F32));
      flow_matching_pair(noisy_n, target_n, x0_n, noise_n, t_n);
      std::vector<float> guidance(static_cast<size_t>(n), static_cast<float>(c.flux.guidance));
      if (!model_config.guidance_embeds) guidance.clear();
      model.forward(FluxInputs{noisy_n, text_n, pooled_n, times, guidance}, compute, pred_n);
      const std::vector<float> p = host_values(pred_n), y = host_values(target_n);
      const size_t per_sample = p.size() / static_cast<size_t>(n);
      for (int64_t j = 0; j < n; ++j) {
        double squares = 0;
        for (size_t e = static_cast<size_t>(j) * per_sample; e < static_cast<size_t>(j + 1) * per_sample; ++e)
          squares += (static_cast<double>(p[e]) - y[e]) * (static_cast<double>(p[e]) - y[e]);
        const int64_t k = samples[static_cast<size_t>(j)] % kTimes;
        sum[static_cast<size_t>(k)] += squares / static_cast<double>(per_sample);
        ++count[static_cast<size_t>(k)];
      }
    }
    first += shard.samples;
  }
  FluxEvalResult r;
  r.step = step;
  r.samples = limit;
  int times_seen = 0;
  for (int k = 0; k < kTimes; ++k) {
    const double mean = count[k] ? sum[k] / static_cast<double>(count[k]) : std::numeric_limits<double>::quiet_NaN();
    r.per_time.push_back(mean);
    if (count[k]) {
      r.loss += mean;
      ++times_seen;
    }
  }
  r.loss /= std::max(times_seen, 1);
  return r;
}

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

int64_t FluxTrainer::train_samples() const { return state_->source ? state_->source->cache.size() : 0; }

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
    log_info("FLUX data: {} ({} samples in {} shards, {} latents{}, {} text tokens): {} micro-batches of {} per "
             "epoch{}",
             s.source->cache.folder(), m.samples, m.shards.size(), m.autoencoder,
             m.distribution() ? " drawn from the posterior" : "", m.text_tokens,
             s.source->batches.batches_per_epoch(), s.shape.batch,
             config_.flux.caption_dropout_prob > 0
                 ? fmt::format("; captions dropped with probability {}", config_.flux.caption_dropout_prob)
                 : std::string());
  }
  const int64_t images_per_global_step = s.shape.batch * accumulation;
  if (observer_) observer_->training_begins(start_step_ * images_per_global_step);
  bool stopped_by_observer = false;
  for (int64_t step = start_step_; step < tc.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    double step_flops = 0;
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
      step_flops += static_cast<double>(shape.batch) *
                    s.model_config.training_flops_per_image(shape.image_tokens(), shape.text_tokens);
      const Shape tokens{shape.batch, shape.image_tokens(), s.model_config.in_channels};
      const Tensor x0 = sized(s.x0, tokens), noise = sized(s.noise, tokens), noisy = sized(s.noisy, tokens),
                   target = sized(s.target, tokens), pred = sized(s.pred, tokens), dpred = sized(s.dpred, tokens),
                   text = sized(s.text, {shape.batch, shape.text_tokens, s.model_config.context_dim});
      if (s.source) {
        const Tensor latents = sized(s.latents, {shape.batch, s.model_config.in_channels / 4, batch.latent_height,
                                                 batch.latent_width});
        FluxCacheReadOptions read;
        // NOTE [FLUX caption dropout]; NOTE [FLUX posterior latents]: eps of sample j of the
        // micro-batch starts at the same offset of its stream as its noise does.
        if (config_.flux.caption_dropout_prob > 0)
          read.empty_caption = caption_dropout_rows(derive_seed(seed, kCaptionDropout), k, shape.batch,
                                                    config_.flux.caption_dropout_prob);
        Tensor eps;
        if (s.source->cache.manifest().distribution()) {
          eps = Tensor::empty(latents.shape());
          random_normal(eps, derive_seed(seed, kPosterior), first * static_cast<uint64_t>(per_sample_latent));
          read.latent_noise = &eps;
        }
        s.source->cache.read(batch.samples, latents, text, s.pooled, read);
        patchify(x0, latents, 2);
      } else {
        random_normal(x0, derive_seed(seed, kLatents), first * static_cast<uint64_t>(per_sample_latent));
        random_normal(text, derive_seed(seed, kText), first * static_cast<uint64_t>(per_sample_text));
        random_normal(s.pooled, derive_seed(seed, kPooled), first * static_cast<uint64_t>(s.model_config.pooled_dim));
      }
      random_normal(noise, derive_seed(seed, kNoise), first * static_cast<uint64_t>(per_sample_latent));
      const std::vector<float> times = sample_flow_timesteps(s.sampling, derive_seed(seed, kTimesteps), step, micro,
                                                             shape.batch, shape.image_tokens());
      s.t.copy_from(Tensor::wrap(const_cast<float*>(times.data()), {shape.batch}, DType::F32));
      flow_matching_pair(noisy, target, x0, noise, s.t);
      FluxInputs inputs{noisy, text, s.pooled, times, guidance};
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
    const int64_t samples = (step + 1) * images_per_global_step;
    if (observer_) {
      StepMetrics m;
      m.step = step + 1;
      m.loss = loss;
      m.lr = h.lr;
      m.grad_norm = norm;
      m.step_time_s = seconds;
      m.model_tflops = step_flops / seconds / 1e12;
      observer_->step_done(m, samples);
    }
    const bool scheduled = s.eval_cache && config_.eval.interval > 0 &&
                           ((step + 1) % config_.eval.interval == 0 || step + 1 == tc.steps);
    if (s.eval_cache && (observer_ ? observer_->evaluation_due(step + 1, samples, scheduled) : scheduled)) {
      if (observer_) observer_->evaluation_begins(samples);
      result.evaluations.push_back(s.evaluate(config_, step + 1));  // NOTE [FLUX validation loss]
      const FluxEvalResult& e = result.evaluations.back();
      if (log)
        log_info("eval  {:>5} | validation loss {:.4f} over {} samples | at t = 0, 1/8, ..., 7/8: {:.4f}", step + 1,
                 e.loss, e.samples, fmt::join(e.per_time, " "));
      EvalMetrics em;
      em.step = step + 1;
      em.loss = e.loss;
      if (observer_ && observer_->evaluation_done(em, samples)) stopped_by_observer = true;
    }
    const int signal = stop_signal();  // NOTE [Stop signals]
    checkpoints_->after_step(step + 1, signal != 0, s.master, s.m, s.v);
    if (signal != 0) {
      if (log) log_info("stopped by signal {} after step {}", signal, step + 1);
      result.stopped = true;
      break;
    }
    if (stopped_by_observer) break;
  }
  checkpoints_->finish();  // an asynchronous save in flight
  if (observer_)
    observer_->training_ends((start_step_ + static_cast<int64_t>(result.losses.size())) * images_per_global_step,
                             stopped_by_observer);
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
