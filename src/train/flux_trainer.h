// FluxTrainer: rectified-flow training of a FLUX transformer (model/flux_transformer.h) on
// one device.
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
// norm scales without weight decay. Micro-batches are synthetic so far: latents, text
// features and pooled vectors drawn from the counter-based normal generator per (seed,
// step, micro-batch) — what `forge bench` measures with; reading cached latents and text
// embeddings is the data layer's next piece (issue 22). Checkpoints and resume: NOTE [FLUX
// checkpoints] and NOTE [Exact FLUX resume] in train/flux_checkpoint.h.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/flux_config.h"
#include "model/flux_transformer.h"
#include "train/experiment.h"
#include "train/flux_checkpoint.h"

namespace forge {

// The transformer an experiment's flux section names (proxy block counts applied).
FluxConfig flux_model_config(const FluxRunConfig& run);
// A micro-batch's shape: the latent grid of flux.resolution, flux.text_tokens.
FluxShape flux_micro_batch_shape(const ExperimentConfig& config);

struct FluxTrainResult {
  std::vector<double> step_seconds;
  std::vector<double> losses;  // mean over each step's micro-batches
  bool stopped = false;        // NOTE [Stop signals]: stopped after a step, its checkpoint saved
};

class FluxTrainer {
 public:
  // `resolved_yaml` goes into the checkpoints (NOTE [FLUX checkpoints] in train/flux_checkpoint.h).
  explicit FluxTrainer(const ExperimentConfig& config, std::string resolved_yaml = "");
  ~FluxTrainer();
  // Runs the steps from the one a resumed run starts at to training.steps; a line per
  // logging.log_interval steps when `log`.
  FluxTrainResult run(bool log = true);

  struct State;  // flux_trainer.cpp

 private:
  ExperimentConfig config_;
  std::unique_ptr<State> state_;
  std::unique_ptr<FluxCheckpoints> checkpoints_;
  int64_t start_step_ = 0;  // steps a resumed run had done
};

}  // namespace forge
