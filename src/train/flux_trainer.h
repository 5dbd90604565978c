// FluxTrainer: rectified-flow training of a FLUX transformer (model/flux_transformer.h) on
// one device, or sharded over data-parallel ranks (NOTE [FLUX FSDP] in distributed/flux_fsdp.h).
//
// NOTE [FLUX runs]
// An experiment with flux.model set trains a FLUX transformer instead of a language model.
// Each micro-batch holds clean latent tokens x0 [B, image_tokens, 64], the text encoder's
// features [B, text_tokens, context_dim] and the pooled text vector; every sample draws a
// time t (NOTE [Flow timesteps] in train/flow_timesteps.h) and noise, the model predicts the
// velocity noise - x0 at x_t = (1 - t) x0 + t noise (ops/flow_matching.h), and the loss is
// the mean squared error. A guidance-embedding model (FLUX.1-dev) is fed flux.guidance.
// Weights are fp32 masters with a bf16 compute copy on CUDA (fp32 on the CPU), gradients
// fp32, AdamW with global-norm clipping and the language models' LR schedules, biases and
// norm scales without weight decay. Micro-batches come from a latent cache (flux.data_path:
// NOTE [FLUX latent cache], drawn as NOTE [FLUX cache batches] says; the model's activations
// are planned for the largest latent grid and re-laid for each batch's), or are synthetic:
// latents, text features and pooled vectors drawn from the counter-based normal generator
// per (seed, step, micro-batch) — what `forge bench` measures with. Either way a
// micro-batch is a pure function of (seed, step, micro-batch): with a cache, so are its
// dropped captions (flux.caption_dropout_prob, NOTE [FLUX caption dropout]) and the latents
// a "distribution" cache's posterior gives (eps from random_normal's stream at the sample's
// offset, NOTE [FLUX posterior latents] in ckpt/flux_latent_cache.h).
// Checkpoints and resume: NOTE [FLUX checkpoints] and NOTE [Exact FLUX resume] in
// train/flux_checkpoint.h.
// Under a launcher with parallelism.data_parallel_shard_degree (and replicate degree) > 1,
// the ranks shard the weights, gradients and AdamW state (NOTE [FLUX FSDP]) and split the
// global batch: micro-batch a of rank r is micro-batch a R + r of the step (R ranks), what
// one device with R times the accumulation reads, so the data stay a pure function of
// (seed, step, micro-batch) and a run on R ranks computes the 1-rank run's losses up to
// fp32 reordering. The loss is the mean over the global batch (summed over the ranks), the
// gradient norm the global one (every rank's chunk), the step lines rank 0's, with images/s
// per GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/flux_config.h"
#include "model/flux_transformer.h"
#include "train/experiment.h"
#include "train/flux_checkpoint.h"
#include "train/training_observer.h"

namespace forge {

class ProcessGroup;

// The transformer an experiment's flux section names (proxy block counts applied).
FluxConfig flux_model_config(const FluxRunConfig& run);
// A micro-batch's shape: the latent grid of flux.resolution, flux.text_tokens.
FluxShape flux_micro_batch_shape(const ExperimentConfig& config);

// NOTE [FLUX validation loss]
// With flux.eval_data_path, a run measures the validation loss every eval.interval steps and
// after the last, as MLPerf Training's Flux.1 benchmark defines it (after SD3, Esser et al.
// 2024): validation sample i (in the cache's order) is noised at the fixed time t = (i mod
// 8) / 8 with noise drawn per sample from the run's seed (the same every evaluation), its
// loss is the mean squared error of the predicted velocity; the losses are averaged per time,
// and the validation loss is the mean of those 8 means. eval.steps micro-batches of
// training.local_batch_size samples are evaluated (the cache's first samples, consecutive
// ones of one shard batched together), or every sample when the cache holds fewer. No
// gradients; the model's activations are re-planned for the last, smaller micro-batch of a
// shard. Captions are never dropped, and a "distribution" cache gives its posterior's mean
// (the mode), so the validation loss stays a fixed function of the weights. (The reference
// encodes COCO images on the fly with its autoencoder; see NOTE [FLUX posterior latents] for
// what it draws and why forge keeps the mode here.)
struct FluxEvalResult {
  int64_t step = 0;  // after this many training steps
  int64_t samples = 0;
  double loss = 0;                   // the mean of per_time
  std::vector<double> per_time;      // the mean loss at t = 0, 1/8, ..., 7/8 (NaN where no sample)
};

struct FluxTrainResult {
  std::vector<double> step_seconds;
  std::vector<double> losses;  // mean over each step's micro-batches
  std::vector<FluxEvalResult> evaluations;
  bool stopped = false;        // NOTE [Stop signals]: stopped after a step, its checkpoint saved
};

class FluxTrainer {
 public:
  // `resolved_yaml` goes into the checkpoints (NOTE [FLUX checkpoints] in train/flux_checkpoint.h).
  // `world`: the process group of the launcher's ranks when the caller holds one (forge
  // bench's); null: the trainer makes its own when several ranks were started.
  explicit FluxTrainer(const ExperimentConfig& config, std::string resolved_yaml = "", ProcessGroup* world = nullptr);
  ~FluxTrainer();
  // Runs the steps from the one a resumed run starts at to training.steps; a line per
  // logging.log_interval steps when `log`.
  FluxTrainResult run(bool log = true);
  // Hears the step loop and may schedule evaluations and stop the run after one
  // (train/training_observer.h; forge mlperf flux1's logger). Samples are images. Not owned.
  // Under data parallelism every rank has one, hearing the same steps, losses and
  // validation losses (summed over the ranks), so their decisions agree.
  void set_observer(TrainingObserver* observer) { observer_ = observer; }
  // The training cache's images (0 with synthetic data).
  int64_t train_samples() const;

  struct State;  // flux_trainer.cpp

 private:
  ExperimentConfig config_;
  std::unique_ptr<State> state_;
  std::unique_ptr<FluxCheckpoints> checkpoints_;
  int64_t start_step_ = 0;  // steps a resumed run had done
  TrainingObserver* observer_ = nullptr;
};

}  // namespace forge
