// FLUX training on one device or data-parallel ranks; see flux_trainer.h.
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
#include "distributed/flux_fsdp.h"
#include "distributed/heartbeat.h"
#include "distributed/launch_env.h"
#include "distributed/process_group.h"
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
#include "train/flux_export.h"
#include "train/run_dir.h"
#include "train/trainer.h"

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
  kPosterior,       // NOTE [FLUX posterior latents]
  kRounding         // NOTE [bf16 master weights]: the optimizer's stochastic rounding
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

// The data-parallel ranks of a run (NOTE [FLUX FSDP] in distributed/flux_fsdp.h), set up
// before anything touches the GPU (the NCCL group makes GPU local_rank this process's
// device). Consecutive ranks shard, ranks data_parallel_shard_degree apart replicate, as a
// language model's (NOTE [Device mesh] in train/trainer.cpp).
struct FluxRanks {
  std::unique_ptr<ProcessGroup> own_world, shard_split, replicate_group;
  ProcessGroup* world = nullptr;
  ProcessGroup* shard_group = nullptr;
  int rank = 0, ranks = 1, shard_ranks = 1;

  FluxRanks(const ExperimentConfig& c, ProcessGroup* given) : world(given) {
    const ParallelismConfig& p = c.parallelism;
    const LaunchEnv env = read_launch_env();
    const int64_t wanted = p.data_parallel_shard_degree * p.data_parallel_replicate_degree;
    if (env.world_size == 1 && wanted > 1)
      FORGE_FAIL("parallelism.data_parallel_shard_degree × data_parallel_replicate_degree = {} × {} = {} ranks, but "
                 "this FLUX run was started alone: start {} ranks (forge launch --nproc-per-node {} -- train ..., "
                 "torchrun or srun)",
                 p.data_parallel_shard_degree, p.data_parallel_replicate_degree, wanted, wanted, wanted);
    if (env.world_size != wanted)
      FORGE_FAIL("{} ranks were started ({}), but parallelism.data_parallel_shard_degree × "
                 "data_parallel_replicate_degree = {} × {} = {}: a FLUX run's ranks are its data-parallel ranks; set "
                 "them so that their product is the number of ranks",
                 env.world_size, describe(env), p.data_parallel_shard_degree, p.data_parallel_replicate_degree, wanted);
    if (wanted == 1) return;
    rank = env.rank;
    ranks = env.world_size;
    shard_ranks = static_cast<int>(p.data_parallel_shard_degree);
    if (!world) {
      own_world = create_process_group(env, process_group_options(c));
      world = own_world.get();
    }
    FORGE_CHECK(world->world_size() == ranks, "the process group given has {} ranks, the launcher started {}",
                world->world_size(), ranks);
    shard_group = world;
    if (p.data_parallel_replicate_degree > 1) {
      shard_split = world->split(rank / shard_ranks, rank);
      replicate_group = world->split(rank % shard_ranks, rank);
      shard_group = shard_split.get();
    }
  }
  bool sharded() const { return ranks > 1; }
};

}  // namespace

struct FluxTrainer::State {
  FluxRanks ranks;  // first: before anything touches the GPU
  FluxConfig model_config;
  std::unique_ptr<CacheSource> source;  // null: synthetic micro-batches
  std::unique_ptr<FluxLatentCache> eval_cache;  // flux.eval_data_path
  FluxShape shape;                      // planned for: the largest micro-batch
  Device device;
  DType dtype;
  // One device: the whole model's masters (fp32, or bf16 with optimizer.master_dtype bf16),
  // compute copy (none on CUDA with bf16 masters: they are the compute weights), fp32
  // gradients and the moments (fp32, or bf16 with optimizer.state_dtype bf16).
  std::unique_ptr<FluxParameters> master, compute, grads, m, v;
  // Data-parallel ranks (NOTE [FLUX FSDP]): this rank's chunks in `fsdp`, AdamW's moments
  // over its segments.
  std::unique_ptr<FluxFsdp> fsdp;
  Tensor m_shard, v_shard;
  std::vector<Tensor> m_segments, v_segments;
  FluxTransformer model;
  // Flat buffers of the largest micro-batch; sized() views them per micro-batch.
  Tensor x0, noise, noisy, target, latents, pred, dpred, text;
  Tensor pooled, t, loss;
  FlowTimestepSampling sampling;

  FluxParamSource& weights() {
    if (fsdp) return *fsdp;
    return compute ? *compute : *master;
  }
  FluxGradSink& gradients() { return fsdp ? static_cast<FluxGradSink&>(*fsdp) : *grads; }

  // NOTE [FLUX validation loss], after `step` training steps.
  FluxEvalResult evaluate(const ExperimentConfig& c, int64_t step);

  State(const ExperimentConfig& c, const FluxConfig& mc, const FluxShape& sh, Device dev, ProcessGroup* world)
      : ranks(c, world), model_config(mc),
        source(c.flux.data_path.empty() ? nullptr : std::make_unique<CacheSource>(c, mc)),
        shape(planned_shape(sh, source.get())), device(dev), dtype(dev == Device::CUDA ? DType::BF16 : DType::F32),
        model(mc, shape, dev, activation_checkpoint_from_name(c.activation_checkpoint.mode),
              c.activation_checkpoint.recompute_blocks),
        sampling(timestep_sampling(c.flux)) {
    if (ranks.sharded()) {
      FsdpOptions options;
      options.zero_stage = static_cast<int>(c.parallelism.zero_stage);
      options.reduce_dtype = c.precision.reduce_dtype == "bf16" ? DType::BF16 : DType::F32;
      fsdp = std::make_unique<FluxFsdp>(mc, dev, *ranks.shard_group, ranks.replicate_group.get(), options);
      const Fsdp& f = fsdp->fsdp();
      m_shard = Tensor::zeros({std::max<int64_t>(f.layout().shard_numel(), 1)}, DType::F32, dev);
      v_shard = Tensor::zeros({std::max<int64_t>(f.layout().shard_numel(), 1)}, DType::F32, dev);
      for (const FsdpSegment& seg : f.layout().segments()) {
        m_segments.push_back(m_shard.narrow(seg.shard_offset, seg.shard_offset + seg.numel));
        v_segments.push_back(v_shard.narrow(seg.shard_offset, seg.shard_offset + seg.numel));
      }
    } else {
      // NOTE [bf16 master weights] in optim/optimizer.h.
      const DType master_dtype = c.optimizer.master_dtype == "bf16" ? DType::BF16 : DType::F32;
      const DType state_dtype = c.optimizer.state_dtype == "bf16" ? DType::BF16 : DType::F32;
      master = std::make_unique<FluxParameters>(mc, dev, master_dtype);
      if (master_dtype != dtype) compute = std::make_unique<FluxParameters>(mc, dev, dtype);
      grads = std::make_unique<FluxParameters>(mc, dev, DType::F32);
      m = std::make_unique<FluxParameters>(mc, dev, state_dtype);
      v = std::make_unique<FluxParameters>(mc, dev, state_dtype);
      // FluxCheckpoints::start then loads what the run starts from.
      master->initialize(c.training.seed, parse_flux_weight_init(c.flux.weight_init, "flux.weight_init"));
      m->zero();
      v->zero();
      grads->zero();  // once: the gaps between its tensors stay 0; the steps write the tensors
    }
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
  }
};

FluxEvalResult FluxTrainer::State::evaluate(const ExperimentConfig& c, int64_t step) {
  constexpr int kTimes = 8;
  const FluxCacheManifest& m = eval_cache->manifest();
  const int64_t batch = shape.batch, limit = std::min(m.samples, c.eval.steps * batch);
  const uint64_t noise_seed = derive_seed(c.training.seed, kEvalNoise);
  // NOTE [FLUX validation loss] under data parallelism: micro-batch b goes to rank b mod R
  // when every rank gets as many (the ZeRO-3 gathers of a forward are collectives), else
  // every rank evaluates them all; the sums and counts are then added over the ranks.
  int64_t micro_batches = 0;
  {
    int64_t first = 0;
    for (const FluxCacheShard& shard : m.shards) {
      for (int64_t row = 0; row < shard.samples && first + row < limit; row += batch) ++micro_batches;
      first += shard.samples;
    }
  }
  const bool split = ranks.sharded() && micro_batches % ranks.ranks == 0;
  std::array<double, kTimes> sum{};
  std::array<int64_t, kTimes> count{};
  int64_t first = 0;  // of the shard
  int64_t index = 0;  // of the micro-batch
  for (const FluxCacheShard& shard : m.shards) {
    for (int64_t row = 0; row < shard.samples && first + row < limit; row += batch) {
      if (split && index++ % ranks.ranks != ranks.rank) continue;
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
      model.forward(FluxInputs{noisy_n, text_n, pooled_n, times, guidance}, weights(), pred_n);
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
  if (split) {  // every rank ends with the same sums and counts
    const std::vector<double> sums = fsdp->fsdp().sum_over_ranks(std::vector<double>(sum.begin(), sum.end()));
    const std::vector<int64_t> counts =
        fsdp->fsdp().counts_over_ranks(std::vector<int64_t>(count.begin(), count.end()));
    for (int k = 0; k < kTimes; ++k) {
      sum[static_cast<size_t>(k)] = sums[static_cast<size_t>(k)];
      count[static_cast<size_t>(k)] = counts[static_cast<size_t>(k)];
    }
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

FluxTrainer::FluxTrainer(const ExperimentConfig& config, std::string resolved_yaml, ProcessGroup* world)
    : config_(config) {
  const Device device = config.training.device == "cuda" ? Device::CUDA : Device::CPU;
  const TrainingConfig& t = config.training;
  set_gemm_tuning(t.gemm_tuning, t.gemm_tuning ? gemm_tuning_cache_dir(t.gemm_tuning_cache) : "");
  state_ = std::make_unique<State>(config_, flux_model_config(config.flux), flux_micro_batch_shape(config), device,
                                   world);
  State& s = *state_;
  checkpoints_ = std::make_unique<FluxCheckpoints>(config_, std::move(resolved_yaml), s.model_config);
  if (!s.fsdp) {
    start_step_ = checkpoints_->start(*s.master, *s.m, *s.v);  // NOTE [FLUX checkpoints]
    if (s.compute) s.compute->assign_from(*s.master);  // NOTE [Exact FLUX resume]: cast as the optimizer casts
    return;
  }
  // NOTE [FLUX FSDP checkpoints] in train/flux_checkpoint.h: each rank loads its segments.
  const uint64_t seed = t.seed;
  const FluxWeightInit init = parse_flux_weight_init(config.flux.weight_init, "flux.weight_init");
  start_step_ = checkpoints_->start(FluxShardedState{&s.fsdp->fsdp(), &s.m_segments, &s.v_segments, s.ranks.rank,
                                                     s.ranks.rank < s.ranks.shard_ranks},
                                    [&](const std::function<void(size_t, std::span<const float>)>& each) {
                                      initialize_flux_tensors(s.model_config, seed, init, kFluxInitStd, each);
                                    });
  const Fsdp& f = s.fsdp->fsdp();
  const FsdpMemory mem = f.memory();
  auto gib = [](int64_t bytes) { return static_cast<double>(bytes) / 1073741824.0; };
  log_info("fsdp rank {} of {} (ZeRO-{}, {} shard ranks x {} replicas): fp32 master chunk {:.3f} GiB, gradient chunk "
           "{:.3f} GiB, AdamW moments {:.3f} GiB = 1/{} of the model's {} parameters; compute weights {:.3f} GiB{}, "
           "full-size gradient buffers {:.3f} GiB, reduction buffers {:.3f} GiB",
           s.ranks.rank, s.ranks.ranks, f.options().zero_stage, s.ranks.shard_ranks,
           s.ranks.ranks / s.ranks.shard_ranks, gib(mem.master_weights), gib(mem.gradient_shard),
           gib(2 * mem.master_weights), s.ranks.shard_ranks, f.layout().parameter_count(), gib(mem.compute_weights),
           f.options().zero_stage == 3 ? " (the embedders and head, three gathered blocks)" : " (every unit)",
           gib(mem.full_gradients), gib(mem.reduce_buffers));
}

FluxTrainer::~FluxTrainer() = default;

int64_t FluxTrainer::train_samples() const { return state_->source ? state_->source->cache.size() : 0; }

FluxTrainResult FluxTrainer::run(bool log) {
  State& s = *state_;
  const TrainingConfig& tc = config_.training;
  const int64_t accumulation = std::max<int64_t>(1, tc.gradient_accumulation_steps);
  // NOTE [FLUX FSDP] data: the global batch is the micro-batches of every rank; micro-batch
  // a of rank r is micro-batch a R + r of the step, the one a single device with R times
  // the accumulation reads in its place (as a language model's DataLoader deals them).
  const int64_t data_ranks = s.ranks.ranks, data_rank = s.ranks.rank;
  const int64_t global_accumulation = accumulation * data_ranks;
  const bool rank0 = data_rank == 0;
  log = log && rank0;  // rank 0 alone prints the step lines
  const uint64_t seed = tc.seed;
  const int64_t per_sample_latent = s.shape.image_tokens() * s.model_config.in_channels;
  const int64_t per_sample_text = s.shape.text_tokens * s.model_config.context_dim;
  FluxTrainResult result;
  std::vector<float> guidance(static_cast<size_t>(s.shape.batch), static_cast<float>(config_.flux.guidance));
  if (!s.model_config.guidance_embeds) guidance.clear();
  const double images_per_step = static_cast<double>(s.shape.batch * accumulation);  // this rank's (per GPU)
  set_op_profiling(config_.logging.profile_ops);
  if (log && s.source) {
    const FluxCacheManifest& m = s.source->cache.manifest();
    log_info("FLUX data: {} ({} samples in {} shards, {} latents{}, {} text tokens): {} micro-batches of {} per "
             "epoch{}{}",
             s.source->cache.folder(), m.samples, m.shards.size(), m.autoencoder,
             m.distribution() ? " drawn from the posterior" : "", m.text_tokens,
             s.source->batches.batches_per_epoch(), s.shape.batch,
             config_.flux.caption_dropout_prob > 0
                 ? fmt::format("; captions dropped with probability {}", config_.flux.caption_dropout_prob)
                 : std::string(),
             data_ranks > 1 ? fmt::format("; each of the {} data-parallel ranks reads {} of the step's {}", data_ranks,
                                          accumulation, global_accumulation)
                            : std::string());
  }
  const int64_t images_per_global_step = s.shape.batch * global_accumulation;
  if (observer_) observer_->training_begins(start_step_ * images_per_global_step);
  bool stopped_by_observer = false;
  for (int64_t step = start_step_; step < tc.steps; ++step) {
    report_step(step + 1);  // NOTE [Failure detection]
    debug_hang_if_requested(static_cast<int>(data_rank), step + 1);
    const auto start = std::chrono::steady_clock::now();
    double step_flops = 0;
    reset_op_profile();
    s.loss.fill_zero();
    if (s.fsdp) s.fsdp->fsdp().begin_step();
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      // Micro-batch k of the run holds its samples k B + j; their noise (and synthetic
      // inputs) start at that offset of each stream, whatever their latent grid.
      const int64_t step_micro = micro * data_ranks + data_rank;  // of the step's global_accumulation
      const int64_t k = step * global_accumulation + step_micro;
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
      const std::vector<float> times = sample_flow_timesteps(s.sampling, derive_seed(seed, kTimesteps), step,
                                                             step_micro, shape.batch, shape.image_tokens());
      s.t.copy_from(Tensor::wrap(const_cast<float*>(times.data()), {shape.batch}, DType::F32));
      flow_matching_pair(noisy, target, x0, noise, s.t);
      FluxInputs inputs{noisy, text, s.pooled, times, guidance};
      if (s.fsdp) s.fsdp->fsdp().begin_micro_batch(micro + 1 == accumulation);
      s.model.forward(inputs, s.weights(), pred);
      mse_loss(s.loss, dpred, pred, target, 1.0f / static_cast<float>(global_accumulation));
      // The first micro-batch writes fresh gradients (NOTE [FLUX FSDP]: every one under ZeRO-2/3).
      s.model.backward(dpred, s.weights(), s.gradients(), s.fsdp ? s.fsdp->overwrite_gradients(micro) : micro == 0);
      if (s.fsdp) s.fsdp->fsdp().end_micro_batch();
    }
    double norm = 0;
    if (s.fsdp) {
      s.fsdp->fsdp().finish_gradients();
      norm = std::sqrt(s.fsdp->fsdp().global_grad_sum_of_squares());  // over every rank's chunk
    } else {
      norm = global_grad_norm({s.grads->flat()});
    }
    const float coefficient = clip_coefficient(norm, tc.max_norm);
    FORGE_CHECK(std::isfinite(norm), "FLUX step {}: the gradient norm is not finite ({})", step + 1, norm);
    AdamWHyper h;
    h.lr = lr_at(config_.optimizer, config_.lr_scheduler, step, tc.steps);
    h.beta1 = config_.optimizer.beta1;
    h.beta2 = config_.optimizer.beta2;
    h.eps = config_.optimizer.eps;
    h.step = step + 1;
    h.grad_scale = coefficient;
    if (s.fsdp) {
      // This rank's segments, each with its weight-decay flag; on CUDA the compute copies
      // FSDP keeps of its chunk are written by the same kernel.
      Fsdp& f = s.fsdp->fsdp();
      const std::vector<FsdpSegment>& segments = f.layout().segments();
      for (size_t i = 0; i < segments.size(); ++i) {
        h.weight_decay = segments[i].weight_decay ? config_.optimizer.weight_decay : 0.0;
        adamw_update(f.master_segments()[i], f.grad_segments()[i], s.m_segments[i], s.v_segments[i], h,
                     s.device == Device::CUDA ? f.compute_segments()[i] : Tensor());
      }
      f.refresh_compute_weights(s.device == Device::CUDA);
    } else {
      // Two calls, with and without weight decay (NOTE [FLUX parameter regions]). bf16
      // masters are rounded with bits of the element's flat index (NOTE [bf16 master weights]).
      h.rounding_seed = derive_seed(seed, kRounding);
      for (const bool decayed : {true, false}) {
        auto region = [&](const FluxParameters& p) { return decayed ? p.decayed() : p.not_decayed(); };
        h.weight_decay = decayed ? config_.optimizer.weight_decay : 0.0;
        h.rounding_offset = decayed ? 0 : s.master->decayed().numel();
        adamw_update(region(*s.master), region(*s.grads), region(*s.m), region(*s.v), h,
                     s.device == Device::CUDA && s.compute ? region(*s.compute) : Tensor());
      }
      if (s.device == Device::CPU && s.compute) s.compute->assign_from(*s.master);
    }
    const Tensor host_loss = s.loss.to(Device::CPU);  // waits for the step's work
    double loss = host_loss.data<float>()[0];
    int signal = stop_signal();  // NOTE [Stop signals]
    if (s.fsdp) {  // the mean over the global batch, and whether any rank was asked to stop
      const auto [loss_sum, stops] = s.fsdp->fsdp().sum_over_ranks(loss, signal != 0 ? 1.0 : 0.0);
      loss = loss_sum;
      if (stops > 0 && signal == 0) signal = -1;  // another rank's signal: stop here too
    }
    loss /= static_cast<double>(global_accumulation);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.step_seconds.push_back(seconds);
    result.losses.push_back(loss);
    FORGE_CHECK(std::isfinite(loss), "FLUX step {}: the loss is not finite ({})", step + 1, loss);
    if (log && ((step + 1) % config_.logging.log_interval == 0 || step + 1 == tc.steps))
      log_info("step {:>5} | loss {:.4f} | grad norm {:.3f} | lr {:.3e} | {:.2f} images/s{} | step {:.1f} ms", step + 1,
               loss, norm, h.lr, images_per_step / seconds, data_ranks > 1 ? "/GPU" : "", seconds * 1e3);
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
    if (s.fsdp)
      checkpoints_->after_step(step + 1, signal != 0,
                               FluxShardedState{&s.fsdp->fsdp(), &s.m_segments, &s.v_segments, s.ranks.rank,
                                                s.ranks.rank < s.ranks.shard_ranks});
    else
      checkpoints_->after_step(step + 1, signal != 0, *s.master, *s.m, *s.v);
    if (signal != 0) {
      if (log) {
        if (signal > 0) log_info("stopped by signal {} after step {}", signal, step + 1);
        else log_info("stopped after step {}: another rank was signalled", step + 1);
      }
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
    const SafetensorsDType stored = export_safetensors_dtype(config_.checkpoint.export_dtype);
    const uint64_t shard_bytes =
        export_max_shard_bytes(config_.checkpoint.export_max_shard_size, kDiffusersMaxShardBytes);
    if (s.fsdp) {
      // NOTE [FLUX export in pieces]: every rank writes its chunks, none gathers the model.
      if (rank0) create_run_dir(dir);
      const std::string how = write_flux_weights_in_pieces(
          dir + "/diffusers", s.model_config, stored, *s.fsdp, s.ranks.rank, s.ranks.rank < s.ranks.shard_ranks,
          static_cast<size_t>(config_.checkpoint.buffer_mb) << 20, shard_bytes);
      if (log) log_info("exported the FLUX weights to {}/diffusers ({}), {}", dir, config_.checkpoint.export_dtype, how);
    } else {
      FluxParameters host(s.model_config);
      host.assign_from(*s.master);
      create_run_dir(dir);
      save_flux_weights(dir + "/diffusers", host, FluxWeightLayout::Diffusers, stored, shard_bytes);
      if (log) log_info("exported the FLUX weights to {}/diffusers ({})", dir, config_.checkpoint.export_dtype);
    }
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
