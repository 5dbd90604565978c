// FLUX runs' checkpoints; see flux_checkpoint.h (NOTE [FLUX checkpoints], NOTE [Exact FLUX
// resume]).
#include "train/flux_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/ranges.h>

#include "ckpt/checkpoint_layout.h"
#include "ckpt/checkpoint_metadata.h"
#include "ckpt/flux_weights.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "distributed/fsdp.h"
#include "ops/elementwise.h"
#include "train/checkpoint_save_job.h"
#include "train/run_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// "'flux-debug' (2 double + 2 single blocks, 2 heads of 16, text features 32)"
std::string describe_flux(const FluxConfig& f) {
  return fmt::format("'{}' ({} double + {} single blocks, {} heads of {}, text features {}, pooled {}{})", f.name,
                     f.num_double_blocks, f.num_single_blocks, f.num_heads, f.head_dim, f.context_dim, f.pooled_dim,
                     f.guidance_embeds ? ", guidance embedding" : "");
}

void check_flux_architecture(const Checkpoint& ck, const FluxConfig& saved, const FluxConfig& model) {
  auto same = [&](const char* key, const auto& a, const auto& b) {
    if (a != b)
      FORGE_FAIL("checkpoint '{}' was saved for another FLUX model: flux_model.{} is {} there, {} in the configured "
                 "model {}",
                 ck.dir, key, fmt::format("{}", a), fmt::format("{}", b), describe_flux(model));
  };
  same("name", saved.name, model.name);
  same("in_channels", saved.in_channels, model.in_channels);
  same("out_channels", saved.resolved_out_channels(), model.resolved_out_channels());
  same("num_heads", saved.num_heads, model.num_heads);
  same("head_dim", saved.head_dim, model.head_dim);
  same("num_double_blocks", saved.num_double_blocks, model.num_double_blocks);
  same("num_single_blocks", saved.num_single_blocks, model.num_single_blocks);
  same("mlp_ratio", saved.mlp_ratio, model.mlp_ratio);
  same("context_dim", saved.context_dim, model.context_dim);
  same("pooled_dim", saved.pooled_dim, model.pooled_dim);
  same("guidance_embeds", saved.guidance_embeds, model.guidance_embeds);
  same("axes_dim", fmt::format("{}", fmt::join(saved.axes_dim, "/")), fmt::format("{}", fmt::join(model.axes_dim, "/")));
  same("rope_theta", saved.rope_theta, model.rope_theta);
  same("timestep_dim", saved.timestep_dim, model.timestep_dim);
  same("norm_eps", saved.norm_eps, model.norm_eps);
}

std::string describe(const TensorRecord& rec) {
  return fmt::format("tensor '{}' ({})", rec.name, flat_state_name(rec.state));
}

// Bytes the kernel says a new allocation can take without swapping (MemAvailable); -1 when unknown.
int64_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return -1;
}

}  // namespace

std::vector<FlatSegment> flux_checkpoint_segments(const FluxParameters& p) {
  std::vector<FlatSegment> segments;
  int64_t offset = 0;
  for (const Tensor& t : p.tensors()) {
    segments.push_back({offset, t.view({t.numel()})});
    offset += t.numel();
  }
  return segments;
}

void check_flux_checkpoint_model(const Checkpoint& ck, const FluxConfig& model, bool same_architecture) {
  const CheckpointMetadata& md = ck.metadata;
  if (!md.flux)
    FORGE_FAIL("checkpoint '{}' holds a language model ('{}', {} layers, hidden {}), not a FLUX transformer; the "
               "configured model is FLUX {}",
               ck.dir, md.model.name, md.model.num_layers, md.model.hidden_size, describe_flux(model));
  const std::string mismatch = fmt::format("it was saved for FLUX {}, the configured model is FLUX {}",
                                           describe_flux(*md.flux), describe_flux(model));
  std::map<std::pair<int, std::string>, const TensorRecord*> saved;
  for (const TensorRecord& rec : md.tensors)
    if (!saved.emplace(std::make_pair(static_cast<int>(rec.state), rec.name), &rec).second)
      FORGE_FAIL("checkpoint '{}' lists {} twice", ck.dir, describe(rec));
  const std::vector<ParamSpec> specs = flux_parameter_specs(model);
  std::vector<std::pair<const TensorRecord*, int64_t>> placed;  // record, flat offset the model gives it
  for (FlatState state : kFlatStates) {
    int64_t offset = 0;
    for (const ParamSpec& spec : specs) {
      auto it = saved.find({static_cast<int>(state), spec.name});
      if (it == saved.end())
        FORGE_FAIL("checkpoint '{}' has no tensor '{}' ({}), which the configured model has: {}", ck.dir, spec.name,
                   flat_state_name(state), mismatch);
      const TensorRecord& rec = *it->second;
      if (rec.shape != spec.shape)
        FORGE_FAIL("checkpoint '{}': {} has shape {}, the configured model expects {}: {}", ck.dir, describe(rec),
                   shape_str(rec.shape), shape_str(spec.shape), mismatch);
      placed.emplace_back(&rec, offset);
      saved.erase(it);
      offset += shape_numel(spec.shape);
    }
  }
  if (!saved.empty())
    FORGE_FAIL("checkpoint '{}' holds {}, which the configured model does not have: {}", ck.dir,
               describe(*saved.begin()->second), mismatch);
  for (const auto& [rec, offset] : placed)
    if (rec->flat_offset != offset)
      FORGE_FAIL("checkpoint '{}': {} is at flat offset {}, the configured model places it at {}", ck.dir,
                 describe(*rec), rec->flat_offset, offset);
  if (same_architecture) check_flux_architecture(ck, *md.flux, model);
}

namespace {

// Starts a save of step state.step: the temporary directory, its shard file and a writer.
void begin_save(CheckpointSaveJob& job, const std::string& folder, const FluxConfig& model, size_t buffer_bytes) {
  const std::vector<ParamSpec> specs = flux_parameter_specs(model);
  int64_t numel = 0;
  for (const ParamSpec& spec : specs) numel += shape_numel(spec.shape);
  const std::vector<ShardRange> ranges = shard_ranges(numel, 1);
  job.layout = checkpoint_layout(specs, ranges);
  job.dir = checkpoint_dir(folder, job.state.step);
  job.staging.emplace(begin_checkpoint_save(folder, job.state.step, ::getpid()));
  create_checkpoint_shard_files(job.staging->temporary_path(), ranges);
  // A buffer that holds the whole state twice over is large enough.
  const size_t buffer = std::min(buffer_bytes, static_cast<size_t>(std::max<int64_t>(numel, 1024)) * 3 * 8);
  job.writer = std::make_unique<ShardFileWriter>(job.staging->temporary_path(), specs, ranges, buffer);
}

StateSegments segments_of(const FluxParameters& master, const FluxParameters& m, const FluxParameters& v) {
  return {flux_checkpoint_segments(master), flux_checkpoint_segments(m), flux_checkpoint_segments(v)};
}

// Waits for the writing, then writes the metadata, renames the directory into place and prunes.
std::string finish_save(CheckpointSaveJob& job, const std::string& folder, const FluxConfig& model,
                        const std::string& experiment_yaml, int64_t keep_latest_k) {
  job.wait();
  job.writer.reset();  // its buffer and file released before the rename
  if (job.error) {
    try {
      std::rethrow_exception(job.error);
    } catch (const std::exception& e) {
      FORGE_FAIL("checkpoint '{}' (step {}) could not be written: {}", job.dir, job.state.step, e.what());
    }
  }
  return finish_flux_checkpoint_save(folder, *job.staging, model, flux_parameter_specs(model), experiment_yaml,
                                     job.state, job.layout, combine_piece_crcs(job.layout.pieces, std::move(job.crcs)),
                                     keep_latest_k);
}

}  // namespace

std::string save_flux_checkpoint(const std::string& folder, const std::string& experiment_yaml,
                                 const TrainingState& state, const FluxParameters& master, const FluxParameters& m,
                                 const FluxParameters& v, int64_t keep_latest_k, size_t buffer_bytes) {
  CheckpointSaveJob job;
  job.state = state;
  begin_save(job, folder, master.config(), buffer_bytes);
  job.snapshot_ready = std::make_unique<DeviceEvent>(master.flat().device());
  job.snapshot_ready->record(nullptr);  // the writer's copies start after the step's kernels
  job.start(segments_of(master, m, v), /*background=*/false);
  return finish_save(job, folder, master.config(), experiment_yaml, keep_latest_k);
}

size_t read_flux_checkpoint(const Checkpoint& ck, FluxParameters& master, FluxParameters* m, FluxParameters* v,
                            size_t buffer_bytes) {
  int64_t largest_piece = 1024;  // bytes: a buffer that holds the largest piece twice is large enough
  for (const TensorRecord& rec : ck.metadata.tensors)
    for (const TensorPiece& p : rec.pieces) largest_piece = std::max(largest_piece, p.byte_length);
  ShardFileReader reader(ck, std::min(buffer_bytes, static_cast<size_t>(largest_piece) * 2));
  const std::pair<FlatState, FluxParameters*> targets[] = {
      {FlatState::Param, &master}, {FlatState::ExpAvg, m}, {FlatState::ExpAvgSq, v}};
  for (const auto& [state, params] : targets)
    if (params)
      for (const FlatSegment& segment : flux_checkpoint_segments(*params)) reader.read(state, segment);
  return reader.staging_bytes();
}

FluxCheckpoints::FluxCheckpoints(const ExperimentConfig& config, std::string resolved_yaml, const FluxConfig& model)
    : config_(config), yaml_(std::move(resolved_yaml)), model_(model),
      run_dir_(expand_run_dir(config.logging.run_dir, config.flux.model)) {}

FluxCheckpoints::~FluxCheckpoints() = default;

std::string FluxCheckpoints::folder() const {
  const std::string& folder = config_.checkpoint.folder;
  if (fs::path(folder).is_absolute()) return folder;
  return run_dir_ + "/" + folder;
}

size_t FluxCheckpoints::buffer_bytes() const { return static_cast<size_t>(config_.checkpoint.buffer_mb) << 20; }

// Empty when the checkpoint is whole; what is wrong with it otherwise. Another model's
// checkpoint is a configuration mistake, not damage: an error, never skipped.
std::string FluxCheckpoints::damage(const std::string& dir, int part, int parts) const {
  std::optional<Checkpoint> ck;
  try {
    ck = open_checkpoint(dir);
  } catch (const Error& e) {
    return e.what();
  }
  check_flux_checkpoint_model(*ck, model_, /*same_architecture=*/true);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    verify_checkpoint_pieces(*ck, part, parts);
  } catch (const Error& e) {
    return e.what();
  }
  if (part == 0)
    log_info("checked the CRC-32s of '{}' ({:.1f} MB{}) in {:.2f} s", dir,
             12.0 * static_cast<double>(ck->metadata.flat_numel) / 1e6,
             parts > 1 ? fmt::format(", this rank's 1/{} of them", parts) : std::string(), seconds_since(t0));
  return "";
}

// NOTE [Choosing the checkpoint to resume], for one rank.
std::optional<std::string> FluxCheckpoints::choose(DataParallelComm* comm, int part, int parts) const {
  const std::string dir_folder = folder();
  const int64_t load_step = config_.checkpoint.load_step;
  // Under data parallelism a checkpoint is whole when every rank found its share whole.
  auto ranks_finding_damage = [&](const std::string& problem) {
    return comm ? std::llround(comm->sum_over_ranks(problem.empty() ? 0.0 : 1.0)) : (problem.empty() ? 0 : 1);
  };
  if (load_step >= 0) {
    const std::string dir = *find_checkpoint(dir_folder, load_step);
    const std::string problem = damage(dir, part, parts);
    const int64_t damaged = ranks_finding_damage(problem);
    if (!problem.empty()) FORGE_FAIL("checkpoint.load_step {}: {}", load_step, problem);
    if (damaged > 0)
      FORGE_FAIL("checkpoint.load_step {}: checkpoint '{}' is damaged: {} other rank(s) found their share of its "
                 "pieces damaged (their logs say where)",
                 load_step, dir, damaged);
    return dir;
  }
  const std::vector<int64_t> steps = checkpoint_steps(dir_folder);
  size_t rejected = 0;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string dir = checkpoint_dir(dir_folder, *it);
    std::string problem = damage(dir, part, parts);
    const int64_t damaged = ranks_finding_damage(problem);
    if (problem.empty() && damaged > 0)
      problem = fmt::format("{} other rank(s) found their share of its pieces damaged (their logs say where)", damaged);
    if (problem.empty()) {
      if (rejected > 0)
        log_warn("resuming from '{}', the newest whole checkpoint ({} newer one{} left as {} for inspection)", dir,
                 rejected, rejected == 1 ? "" : "s", rejected == 1 ? "it is" : "they are");
      return dir;
    }
    log_warn("checkpoint '{}' cannot be resumed from: {}; trying the one before it", dir, problem);
    ++rejected;
  }
  if (rejected > 0)
    FORGE_FAIL("no checkpoint in '{}' can be resumed from: all {} are damaged (see the warnings above); move them "
               "away to start the run afresh",
               dir_folder, rejected);
  return std::nullopt;
}

std::string FluxCheckpoints::initial_checkpoint_dir(const std::string& path) const {
  std::error_code error;
  if (!fs::is_directory(path, error))
    FORGE_FAIL("checkpoint.initial_load_path '{}' is not a directory: a FLUX run starts there from a forge "
               "checkpoint (a step-<N> directory, or a folder of them); diffusers' and BFL's weights are read by "
               "flux.initial_load_path",
               path);
  if (fs::exists(fs::path(path) / kCheckpointMetadataFile, error)) return path;
  const std::vector<int64_t> steps = checkpoint_steps(path);
  if (steps.empty())
    FORGE_FAIL("checkpoint.initial_load_path '{}' is not a forge checkpoint: it has no {} and no step-<N> "
               "directories (diffusers' and BFL's FLUX weights are read by flux.initial_load_path)",
               path, kCheckpointMetadataFile);
  return checkpoint_dir(path, steps.back());
}

void FluxCheckpoints::load_initial_checkpoint(const std::string& path, FluxParameters& master) const {
  const std::string dir = initial_checkpoint_dir(path);
  const Checkpoint ck = open_checkpoint(dir);
  check_flux_checkpoint_model(ck, model_, /*same_architecture=*/false);
  const size_t staged = read_flux_checkpoint(ck, master, nullptr, nullptr, buffer_bytes());
  log_info("initial FLUX weights from checkpoint '{}' (checkpoint.initial_load_path; saved at step {}; peak host "
           "staging {:.1f} MiB); the optimizer starts fresh at step 0",
           dir, ck.metadata.training.step, static_cast<double>(staged) / 1048576.0);
}

int64_t FluxCheckpoints::start(FluxParameters& master, FluxParameters& m, FluxParameters& v) {
  const CheckpointConfig& c = config_.checkpoint;
  const std::optional<std::string> resume = c.enable ? choose() : std::nullopt;
  if (!resume) {
    if (!c.initial_load_path.empty()) {
      load_initial_checkpoint(c.initial_load_path, master);
    } else if (!config_.flux.initial_load_path.empty()) {  // NOTE [FLUX weight files], a tensor at a time
      read_flux_weights(config_.flux.initial_load_path, model_, master.specs(),
                        [&](size_t spec, std::span<const float> values) {
                          const Tensor& dst = master.tensors()[spec];
                          const Tensor src = Tensor::wrap(const_cast<float*>(values.data()), dst.shape(), DType::F32);
                          cast(dst, dst.device() == Device::CPU ? src : src.to(dst.device()));
                        });
      log_info("FLUX weights from {}", config_.flux.initial_load_path);
    }
    return 0;
  }
  if (!c.initial_load_path.empty() || !config_.flux.initial_load_path.empty())
    log_info("{} is ignored: resuming from a checkpoint of this run",
             c.initial_load_path.empty() ? "flux.initial_load_path" : "checkpoint.initial_load_path");
  const auto t0 = std::chrono::steady_clock::now();
  const Checkpoint ck = open_checkpoint(*resume);
  check_flux_checkpoint_model(ck, model_, /*same_architecture=*/true);
  const size_t staged = read_flux_checkpoint(ck, master, &m, &v, buffer_bytes());
  const TrainingState& saved = ck.metadata.training;
  log_info("resuming from checkpoint '{}' at step {} (data position {}; peak host staging {:.1f} MiB; {:.2f} s)",
           *resume, saved.step, saved.data_position, static_cast<double>(staged) / 1048576.0, seconds_since(t0));
  log_resume_notices(saved);
  return saved.step;
}

// What a resumed run differs in from the run that saved: the seed, the schedule's length, or
// nothing left to train.
void FluxCheckpoints::log_resume_notices(const TrainingState& saved) const {
  if (saved.seed != config_.training.seed)
    log_warn("the checkpoint was saved with training.seed {}, this run has {}: the data and noise differ from the "
             "saved run's",
             saved.seed, config_.training.seed);
  if (saved.lr_schedule_steps != config_.training.steps)
    log_info("the LR schedule now spans training.steps = {} (the checkpoint's run had {})", config_.training.steps,
             saved.lr_schedule_steps);
  if (saved.step >= config_.training.steps)
    log_info("the checkpoint is at step {}, training.steps is {}: nothing to train", saved.step,
             config_.training.steps);
}

bool FluxCheckpoints::due(int64_t steps_done, bool stopping) const {
  const CheckpointConfig& c = config_.checkpoint;
  return c.enable && (steps_done % c.interval == 0 || steps_done == config_.training.steps || stopping);
}

void FluxCheckpoints::after_step(int64_t steps_done, bool stopping, const FluxParameters& master,
                                 const FluxParameters& m, const FluxParameters& v) {
  if (due(steps_done, stopping)) save(steps_done, master, m, v);
}

void FluxCheckpoints::after_step(int64_t steps_done, bool stopping, const FluxShardedState& state) {
  if (due(steps_done, stopping)) save(steps_done, state);
}

TrainingState FluxCheckpoints::training_state(int64_t step) const {
  TrainingState state;
  state.step = step;
  state.data_position = step;  // NOTE [Exact FLUX resume]: the step count is the data position
  state.seed = config_.training.seed;
  state.lr_schedule_steps = config_.training.steps;
  state.optimizer = config_.optimizer;
  state.optimizer_step = step;
  return state;
}

namespace {

// A reader whose buffer holds the checkpoint's largest piece twice (or checkpoint.buffer_mb).
size_t reader_buffer(const Checkpoint& ck, size_t buffer_bytes) {
  int64_t largest_piece = 1024;
  for (const TensorRecord& rec : ck.metadata.tensors)
    for (const TensorPiece& p : rec.pieces) largest_piece = std::max(largest_piece, p.byte_length);
  return std::min(buffer_bytes, static_cast<size_t>(largest_piece) * 2);
}

}  // namespace

int64_t FluxCheckpoints::start(const FluxShardedState& st, const FluxTensorInitializer& initialize) {
  const CheckpointConfig& c = config_.checkpoint;
  Fsdp& fsdp = *st.fsdp;
  const int ranks = static_cast<int>(fsdp.data_parallel_ranks());
  const std::optional<std::string> resume = c.enable ? choose(&fsdp, st.rank, ranks) : std::nullopt;
  if (!resume) {
    // NOTE [FLUX FSDP checkpoints]: each rank writes only its segments of the starting weights.
    if (!c.initial_load_path.empty()) {
      const std::string dir = initial_checkpoint_dir(c.initial_load_path);
      const Checkpoint ck = open_checkpoint(dir);
      check_flux_checkpoint_model(ck, model_, /*same_architecture=*/false);  // the same flat offsets
      ShardFileReader reader(ck, reader_buffer(ck, buffer_bytes()));
      const std::vector<FsdpSegment>& segments = fsdp.layout().segments();
      for (size_t i = 0; i < segments.size(); ++i)
        reader.read(FlatState::Param, {segments[i].flat_offset, fsdp.master_segments()[i]});
      if (st.rank == 0)
        log_info("initial FLUX weights from checkpoint '{}' (checkpoint.initial_load_path; saved at step {}; each "
                 "rank read its own segments); the optimizer starts fresh at step 0",
                 dir, ck.metadata.training.step);
    } else if (!config_.flux.initial_load_path.empty()) {  // NOTE [FLUX weight files], a tensor at a time
      read_flux_weights(config_.flux.initial_load_path, model_, flux_parameter_specs(model_),
                        [&](size_t spec, std::span<const float> values) {
                          fsdp.set_parameter(spec, Tensor::wrap(const_cast<float*>(values.data()),
                                                                {static_cast<int64_t>(values.size())}, DType::F32));
                        });
      if (st.rank == 0)
        log_info("FLUX weights from {} (read a tensor at a time; each rank kept its segments)",
                 config_.flux.initial_load_path);
    } else {
      initialize([&](size_t spec, std::span<const float> values) {
        fsdp.set_parameter(spec, Tensor::wrap(const_cast<float*>(values.data()),
                                              {static_cast<int64_t>(values.size())}, DType::F32));
      });
    }
    fsdp.refresh_compute_weights(false);
    return 0;
  }
  if (st.rank == 0 && (!c.initial_load_path.empty() || !config_.flux.initial_load_path.empty()))
    log_info("{} is ignored: resuming from a checkpoint of this run",
             c.initial_load_path.empty() ? "flux.initial_load_path" : "checkpoint.initial_load_path");
  const auto t0 = std::chrono::steady_clock::now();
  const Checkpoint ck = open_checkpoint(*resume);
  check_flux_checkpoint_model(ck, model_, /*same_architecture=*/true);
  ShardFileReader reader(ck, reader_buffer(ck, buffer_bytes()));
  const std::vector<FsdpSegment>& segments = fsdp.layout().segments();
  for (size_t i = 0; i < segments.size(); ++i) {
    const int64_t at = segments[i].flat_offset;
    reader.read(FlatState::Param, {at, fsdp.master_segments()[i]});
    reader.read(FlatState::ExpAvg, {at, st.m->at(i)});
    reader.read(FlatState::ExpAvgSq, {at, st.v->at(i)});
  }
  fsdp.refresh_compute_weights(false);
  const TrainingState& saved = ck.metadata.training;
  if (st.rank == 0) {
    log_info("resuming from checkpoint '{}' at step {} (data position {}; each of {} ranks read its own segments; "
             "peak host staging {:.1f} MiB; {:.2f} s)",
             *resume, saved.step, saved.data_position, ranks, static_cast<double>(reader.staging_bytes()) / 1048576.0,
             seconds_since(t0));
    log_resume_notices(saved);
  }
  return saved.step;
}

namespace {

// NOTE [FLUX FSDP checkpoints], async: copies this rank's segments into one buffer per vector
// in spare GPU memory, else host memory, and points the segments at the copies; false (a
// warning said why) when neither holds them.
bool snapshot_segments(CheckpointSaveJob& job, StateSegments& segments, Device device) {
  std::array<int64_t, 3> numel{};
  for (size_t s = 0; s < 3; ++s)
    for (const FlatSegment& segment : segments[s]) numel[s] += segment.data.numel();
  const int64_t bytes = 4 * (numel[0] + numel[1] + numel[2]);
  Device place = Device::CPU;
  if (device == Device::CUDA) {
    const DeviceMemoryInfo info = device_memory_info();
    const int64_t margin = std::max<int64_t>(int64_t{1} << 30, static_cast<int64_t>(info.total / 20));
    if (bytes + margin <= static_cast<int64_t>(info.free)) place = Device::CUDA;
  }
  const int64_t host_free = host_memory_available();
  if (place == Device::CPU && (host_free < 0 || bytes + (int64_t{2} << 30) > host_free)) {
    log_warn("checkpoint.async_mode async: a snapshot of this rank's state takes {:.2f} GiB, more than spare GPU memory "
             "or available host memory ({:.2f} GiB) hold; step {} is saved synchronously",
             bytes / 1073741824.0, host_free / 1073741824.0, job.state.step);
    return false;
  }
  try {
    for (size_t s = 0; s < 3; ++s) {
      job.snapshot[s] = Tensor::empty({std::max<int64_t>(numel[s], 1)}, DType::F32, place);
      int64_t at = 0;
      for (FlatSegment& segment : segments[s]) {
        const Tensor copy = job.snapshot[s].narrow(at, at + segment.data.numel());
        copy.copy_from(segment.data);
        segment.data = copy;
        at += copy.numel();
      }
    }
  } catch (const OutOfMemoryError& e) {
    log_warn("checkpoint.async_mode async: no room for the snapshot of step {} ({}); it is saved synchronously",
             job.state.step, e.what());
    job.snapshot = {};
    return false;
  }
  job.snapshot_ready = std::make_unique<DeviceEvent>(place);
  job.snapshot_ready->record(nullptr);
  job.snapshot_place = place == Device::CUDA ? "GPU memory" : "host memory";
  job.snapshot_bytes = static_cast<size_t>(bytes);
  return true;
}

}  // namespace

// NOTE [FLUX FSDP checkpoints]: every rank of the first replica writes its segments; with
// checkpoint.async_mode async from a snapshot, on a thread, the completion deferred.
void FluxCheckpoints::save(int64_t step, const FluxShardedState& st) {
  finish();  // the save before (its collectives run here, on every rank at the same point)
  Fsdp& fsdp = *st.fsdp;
  const std::string dir_folder = folder();
  auto job = std::make_unique<CheckpointSaveJob>();
  job->started = std::chrono::steady_clock::now();
  job->state = training_state(step);
  const std::vector<ParamSpec> specs = flux_parameter_specs(model_);
  int64_t numel = 0;
  for (const ParamSpec& spec : specs) numel += shape_numel(spec.shape);
  const std::vector<ShardRange> ranges = shard_ranges(numel, 1);
  job->layout = checkpoint_layout(specs, ranges);
  job->dir = checkpoint_dir(dir_folder, step);
  // One name for the temporary directory on every rank: rank 0's pid.
  const int64_t token = std::llround(fsdp.sum_over_ranks(st.rank == 0 ? static_cast<double>(::getpid()) : 0.0));
  if (st.rank == 0) {
    job->staging.emplace(begin_checkpoint_save(dir_folder, step, token));
    create_checkpoint_shard_files(job->staging->temporary_path(), ranges);
  }
  fsdp.sum_over_ranks(0.0);  // a barrier: the shard file exists before any rank opens it
  const bool async_mode = config_.checkpoint.async_mode == "async";
  if (st.writer) {
    StateSegments segments;
    const std::vector<FsdpSegment>& layout = fsdp.layout().segments();
    int64_t elements = 0;
    for (size_t i = 0; i < layout.size(); ++i) {
      segments[0].push_back({layout[i].flat_offset, fsdp.master_segments()[i]});
      segments[1].push_back({layout[i].flat_offset, st.m->at(i)});
      segments[2].push_back({layout[i].flat_offset, st.v->at(i)});
      elements += 3 * layout[i].numel;
    }
    const size_t buffer = std::min(buffer_bytes(), static_cast<size_t>(std::max<int64_t>(elements, 1024)) * 8);
    job->writer =
        std::make_unique<ShardFileWriter>(checkpoint_temporary_dir(dir_folder, step, token), specs, ranges, buffer);
    const bool async = async_mode && snapshot_segments(*job, segments, fsdp.master_shard().device());
    if (!async) {
      job->snapshot_ready = std::make_unique<DeviceEvent>(fsdp.master_shard().device());
      job->snapshot_ready->record(nullptr);  // the writer's copies start after the step's kernels
    }
    job->start(std::move(segments), async);
    job->stall_seconds = seconds_since(job->started);
  }
  sharded_job_ = std::move(job);
  sharded_state_ = st;
  // Every rank defers the completion in async mode, whether its snapshot fitted or not, so
  // that all ranks run its collectives at the same point.
  if (!async_mode) finish();
}

void FluxCheckpoints::finish_sharded() {
  std::unique_ptr<CheckpointSaveJob> job = std::move(sharded_job_);
  const FluxShardedState& st = sharded_state_;
  Fsdp& fsdp = *st.fsdp;
  job->wait();
  const size_t staging = job->writer ? job->writer->staging_bytes() : 0;
  job->writer.reset();  // its buffer and file released before the rename
  std::string failure;
  if (job->error) {
    try {
      std::rethrow_exception(job->error);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  const std::string what = fmt::format("checkpoint '{}' (step {})", job->dir, job->state.step);
  const double failed = fsdp.sum_over_ranks(failure.empty() ? 0.0 : 1.0);
  if (!failure.empty()) FORGE_FAIL("{} could not be written by rank {}: {}", what, st.rank, failure);
  if (failed > 0)
    FORGE_FAIL("{} could not be written: {} rank(s) failed to write their part (their logs say why)", what,
               std::llround(failed));
  // Every shard rank's CRC-32s (rank 0's shard group holds the writers).
  std::vector<PieceCrc> parts = std::move(job->crcs);
  const std::vector<uint32_t> counts = fsdp.all_gather_words({static_cast<uint32_t>(parts.size())});
  const uint32_t longest = *std::max_element(counts.begin(), counts.end());
  std::vector<uint32_t> words = encode_piece_crcs(parts);
  words.resize(static_cast<size_t>(longest) * kPieceCrcWords, 0);
  const std::vector<uint32_t> all = fsdp.all_gather_words(words);
  parts.clear();
  for (size_t r = 0; r < counts.size(); ++r) {
    const std::vector<PieceCrc> theirs = decode_piece_crcs(all.data() + r * longest * kPieceCrcWords, counts[r]);
    parts.insert(parts.end(), theirs.begin(), theirs.end());
  }
  if (st.rank == 0)
    finish_flux_checkpoint_save(folder(), *job->staging, model_, flux_parameter_specs(model_), yaml_, job->state,
                                job->layout, combine_piece_crcs(job->layout.pieces, std::move(parts)),
                                config_.checkpoint.keep_latest_k);
  fsdp.sum_over_ranks(0.0);  // a barrier: the checkpoint is in place before any rank goes on
  if (st.rank != 0) return;
  std::string how = fmt::format("each of {} ranks wrote its own segments; peak host staging {:.1f} MiB on rank 0",
                                fsdp.layout().world_size(), static_cast<double>(staging) / 1048576.0);
  if (!job->snapshot_place.empty())
    how = fmt::format("asynchronous: the step loop waited {:.2f} s for rank 0's {:.2f} GiB snapshot in {}; {}",
                      job->stall_seconds, job->snapshot_bytes / 1073741824.0, job->snapshot_place, how);
  log_info("saved checkpoint '{}' ({:.1f} MB in {:.2f} s; {})", job->dir,
           12.0 * static_cast<double>(job->layout.file_numel.at(0)) / 1e6, seconds_since(job->started), how);
}

// NOTE [Async checkpoints] (train/trainer_checkpoint.cpp) for one device: the snapshot is a
// copy of the three flat buffers, padding included.
void FluxCheckpoints::save(int64_t step, const FluxParameters& master, const FluxParameters& m,
                           const FluxParameters& v) {
  finish();
  auto job = std::make_unique<CheckpointSaveJob>();
  job->started = std::chrono::steady_clock::now();
  job->state = training_state(step);
  begin_save(*job, folder(), model_, buffer_bytes());
  const Device device = master.flat().device();
  bool async = false;
  if (config_.checkpoint.async_mode == "async") {
    // In each one's dtype (NOTE [bf16 master weights]: bf16 weights and moments stay bf16).
    const int64_t bytes = static_cast<int64_t>(master.flat().nbytes() + m.flat().nbytes() + v.flat().nbytes());
    Device place = Device::CPU;
    if (device == Device::CUDA) {
      const DeviceMemoryInfo info = device_memory_info();
      const int64_t margin = std::max<int64_t>(int64_t{1} << 30, static_cast<int64_t>(info.total / 20));
      if (bytes + margin <= static_cast<int64_t>(info.free)) place = Device::CUDA;
    }
    const int64_t host_free = host_memory_available();
    if (place == Device::CPU && (host_free < 0 || bytes + (int64_t{2} << 30) > host_free)) {
      log_warn("checkpoint.async_mode async: a snapshot of the state takes {:.2f} GiB, more than spare GPU memory or "
               "available host memory ({:.2f} GiB) hold; step {} is saved synchronously",
               bytes / 1073741824.0, host_free / 1073741824.0, step);
    } else {
      try {
        for (const FluxParameters* p : {&master, &m, &v}) {
          snapshot_.push_back(std::make_unique<FluxParameters>(model_, place, p->flat().dtype()));
          snapshot_.back()->flat().copy_from(p->flat());
        }
        job->snapshot_ready = std::make_unique<DeviceEvent>(place);
        job->snapshot_ready->record(nullptr);
        job->snapshot_place = place == Device::CUDA ? "GPU memory" : "host memory";
        job->snapshot_bytes = static_cast<size_t>(bytes);
        async = true;
      } catch (const OutOfMemoryError& e) {
        log_warn("checkpoint.async_mode async: no room for the snapshot of step {} ({}); it is saved synchronously",
                 step, e.what());
        snapshot_.clear();
      }
    }
  }
  if (async) {
    job->start(segments_of(*snapshot_[0], *snapshot_[1], *snapshot_[2]), /*background=*/true);
  } else {
    job->snapshot_ready = std::make_unique<DeviceEvent>(device);
    job->snapshot_ready->record(nullptr);  // the writer's copies start after the step's kernels
    job->start(segments_of(master, m, v), /*background=*/false);
  }
  job->stall_seconds = seconds_since(job->started);
  job_ = std::move(job);
  if (!async) finish();
}

void FluxCheckpoints::finish() {
  if (sharded_job_) finish_sharded();
  if (!job_) return;
  std::unique_ptr<CheckpointSaveJob> job = std::move(job_);
  const size_t staging = job->writer ? job->writer->staging_bytes() : 0;
  finish_save(*job, folder(), model_, yaml_, config_.checkpoint.keep_latest_k);
  snapshot_.clear();
  std::string how = fmt::format("peak host staging {:.1f} MiB", static_cast<double>(staging) / 1048576.0);
  if (!job->snapshot_place.empty())
    how = fmt::format("asynchronous: the step loop waited {:.2f} s for a {:.2f} GiB snapshot in {}; {}",
                      job->stall_seconds, job->snapshot_bytes / 1073741824.0, job->snapshot_place, how);
  log_info("saved checkpoint '{}' ({:.1f} MB in {:.2f} s; {})", job->dir,
           12.0 * static_cast<double>(job->layout.file_numel.at(0)) / 1e6, seconds_since(job->started), how);
}

}  // namespace forge
