// Checkpoints of FLUX runs: saving the training state every checkpoint.interval steps,
// resuming from the newest whole checkpoint, starting from a checkpoint's weights.
//
// NOTE [FLUX checkpoints]
// A FLUX run's checkpoint is a forge checkpoint (NOTE [Checkpoint format] in
// ckpt/checkpoint.h, format 1, one shard file), so the [checkpoint] section works as for a
// language model: checkpoint.enable, interval, folder (relative to logging.run_dir),
// keep_latest_k, load_step, buffer_mb, async_mode (NOTE [Async checkpoints] in
// train/trainer_checkpoint.cpp) and initial_load_path, with the same atomic saves (NOTE
// [Atomic checkpoints]), CRC-32 per piece and choice of the newest whole checkpoint (NOTE
// [Choosing the checkpoint to resume] in train/trainer_resume.cpp).
//   metadata.json  "flux_model" (every FluxConfig field) in place of a language model's
//                  "model": a language-model run refuses the checkpoint, and a FLUX run
//                  refuses a language model's, naming the file;
//   rank-0.bin     the fp32 master weights, AdamW's m and v, each the tensors of
//                  flux_parameter_specs end to end (FluxParameters' padding between tensors,
//                  NOTE [FLUX parameter regions], is not stored: it is 0 and stays 0).
// The tensors stream between the flat buffers (host or GPU) and the file through
// checkpoint.buffer_mb (NOTE [Streaming checkpoints] in ckpt/checkpoint_stream.h).
//
// NOTE [Exact FLUX resume]
// A FLUX step is a pure function of the fp32 master weights, AdamW's m and v, the step
// count and the config: the optimizer's bias correction takes the step count, the LR
// schedule the step and training.steps, and every micro-batch (its latents, text features,
// noise and timesteps) is drawn from training.seed per (step, micro-batch). Batches read
// from a latent cache are a pure function of (seed, step) too, so the step count is the
// data position: the checkpoint records it as both "step" and "data.position", and there
// is nothing else to restore (the compute weights, bf16 on CUDA, are cast again from the
// masters, as the optimizer casts them). A resumed run thus computes bit for bit what the
// uninterrupted one does, on the CPU; on CUDA as far as the kernels are deterministic. Under
// FSDP (NOTE [FLUX FSDP checkpoints]) the same holds on the same ranks (every rank's
// micro-batches are functions of (seed, step, micro-batch) too); resumed on another number
// of ranks, the gradients' sums are taken in another order (fp32 rounding).
// Changing training.seed, the batch size or accumulation, flux.resolution or the data
// between the runs changes the data that follows, as it would for a language model.
//
// NOTE [FLUX FSDP checkpoints]
// Under FSDP (NOTE [FLUX FSDP] in distributed/flux_fsdp.h) the checkpoint is the same
// files: FSDP's segments are runs of the flat index space flux_parameter_specs lays end to
// end, the checkpoint's. A save is the language models' parallel save (NOTE [Parallel
// checkpoint saves]): rank 0 makes the temporary directory and the shard file, every rank
// of the first replica streams its own segments of the master weights and AdamW's moments
// into it at their flat offsets (no gather), the writers' CRC-32s are all-gathered, and
// rank 0 writes the metadata and renames the directory into place; the ranks must share a
// filesystem. With checkpoint.async_mode async each writer copies its segments into a
// snapshot (spare GPU memory, else host memory, else it saves synchronously) and a thread
// writes them while training goes on; the completion (whether every writer succeeded, the
// CRC-32s, the metadata and rename, a barrier) runs on every rank at the next save or at the
// end of the run, so the checkpoint appears on disk only then, as the language models' (NOTE
// [Async checkpoints] in train/trainer_checkpoint.cpp). A resume has every rank check its share of the pieces' CRC-32s (the ranks agree
// on the newest whole checkpoint) and read its own segments only, so a checkpoint saved on
// N ranks, or on one device, resumes on M. Weights a run starts from come the same way: a
// checkpoint's (checkpoint.initial_load_path) as each rank's segments, the seeded
// initialization one tensor at a time (each rank draws every tensor, in a host buffer of the
// largest one, and keeps its segments), and diffusers' or BFL's weights
// (flux.initial_load_path) alike, a tensor at a time through one host buffer of the largest
// (read_flux_weights in ckpt/flux_weights.h): no rank holds the whole model in host memory.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_stream.h"
#include "model/flux_parameters.h"
#include "train/experiment.h"

namespace forge {

// Each tensor of `p` as a segment at its place in the checkpoint's flat index space
// (flux_parameter_specs end to end).
std::vector<FlatSegment> flux_checkpoint_segments(const FluxParameters& p);

// Errors, naming the checkpoint, unless it is a FLUX checkpoint holding exactly `model`'s
// tensors (names, shapes, flat offsets): a language model's checkpoint, another preset or
// another block count is refused. With `same_architecture` (a resume) every FluxConfig
// field must also be the same; without (weights to start from) matching tensors suffice.
void check_flux_checkpoint_model(const Checkpoint& checkpoint, const FluxConfig& model, bool same_architecture);

// Saves `state` with master, m and v (any device, fp32) to <folder>/step-<state.step>,
// synchronously; keep_latest_k as save_checkpoint's. Returns the directory.
std::string save_flux_checkpoint(const std::string& folder, const std::string& experiment_yaml,
                                 const TrainingState& state, const FluxParameters& master, const FluxParameters& m,
                                 const FluxParameters& v, int64_t keep_latest_k, size_t buffer_bytes);

// Fills master (and m and v, when given) from the checkpoint, checking every piece's CRC-32;
// check_flux_checkpoint_model first. Returns the host bytes staged.
size_t read_flux_checkpoint(const Checkpoint& checkpoint, FluxParameters& master, FluxParameters* m,
                            FluxParameters* v, size_t buffer_bytes);

struct CheckpointSaveJob;
class DataParallelComm;
class Fsdp;

// Calls its argument with each parameter's initial values (initialize_flux_tensors).
using FluxTensorInitializer = std::function<void(const std::function<void(size_t, std::span<const float>)>&)>;

// A data-parallel rank's state (NOTE [FLUX FSDP checkpoints]): FSDP's master segments and
// AdamW's moments over the same segments.
struct FluxShardedState {
  Fsdp* fsdp = nullptr;
  const std::vector<Tensor>* m = nullptr;
  const std::vector<Tensor>* v = nullptr;
  int rank = 0;         // among every data-parallel rank
  bool writer = false;  // a rank of the first replica: saves its segments
};

// A FLUX run's checkpoints, as the run's [checkpoint] section asks.
class FluxCheckpoints {
 public:
  FluxCheckpoints(const ExperimentConfig& config, std::string resolved_yaml, const FluxConfig& model);
  ~FluxCheckpoints();

  // The run's state before its first step: with checkpoint.enable, the newest whole
  // checkpoint in the folder (or checkpoint.load_step's); else the weights of
  // checkpoint.initial_load_path (a FLUX checkpoint, or a folder of them: the newest) or
  // flux.initial_load_path (diffusers or BFL weights), m and v left as they are (0). Returns
  // the number of steps done, where the run goes on.
  int64_t start(FluxParameters& master, FluxParameters& m, FluxParameters& v);
  // The same for a data-parallel rank (NOTE [FLUX FSDP checkpoints]): a resume, or
  // checkpoint.initial_load_path, reads its segments; flux.initial_load_path a tensor at a time;
  // otherwise `initialize` hands each tensor's seeded initial values in turn and the rank
  // keeps its segments of them.
  int64_t start(const FluxShardedState& state, const FluxTensorInitializer& initialize);
  // After step `steps_done`'s update: with checkpoint.enable, saves at multiples of
  // checkpoint.interval, the last step, and when `stopping`.
  void after_step(int64_t steps_done, bool stopping, const FluxParameters& master, const FluxParameters& m,
                  const FluxParameters& v);
  void after_step(int64_t steps_done, bool stopping, const FluxShardedState& state);
  // Completes an asynchronous save still in flight (at the end of the run; under FSDP on
  // every rank: it runs collectives).
  void finish();
  // logging.run_dir expanded once, for the checkpoints and the export.
  const std::string& run_dir() const { return run_dir_; }
  std::string folder() const;

 private:
  void save(int64_t step, const FluxParameters& master, const FluxParameters& m, const FluxParameters& v);
  void save(int64_t step, const FluxShardedState& state);
  bool due(int64_t steps_done, bool stopping) const;
  void log_resume_notices(const TrainingState& saved) const;
  TrainingState training_state(int64_t step) const;
  // NOTE [Choosing the checkpoint to resume]; with `comm`, rank `part` of `parts` checks its
  // share of the CRC-32s and the ranks agree.
  std::optional<std::string> choose(DataParallelComm* comm = nullptr, int part = 0, int parts = 1) const;
  std::string damage(const std::string& dir, int part = 0, int parts = 1) const;
  std::string initial_checkpoint_dir(const std::string& path) const;  // checkpoint.initial_load_path's step-<N>
  void load_initial_checkpoint(const std::string& path, FluxParameters& master) const;
  size_t buffer_bytes() const;

  ExperimentConfig config_;
  std::string yaml_;
  FluxConfig model_;
  std::string run_dir_;
  // What an asynchronous save writes from; declared before job_, so that an abandoned job's
  // writer thread is joined before the snapshot goes.
  std::vector<std::unique_ptr<FluxParameters>> snapshot_;
  std::unique_ptr<CheckpointSaveJob> job_;
  // NOTE [FLUX FSDP checkpoints]: a data-parallel rank's save whose completion (the ranks'
  // collectives, rank 0's metadata and rename) waits for the next save or finish().
  void finish_sharded();
  std::unique_ptr<CheckpointSaveJob> sharded_job_;
  FluxShardedState sharded_state_;
};

}  // namespace forge
