// The trainer's side of checkpoints: which folder, what a save captures (world 1: every
// parameter and moment tensor; FSDP: this rank's segments; under tensor parallelism, of its
// shards), and what a resume or a fine-tuning start restores, all streamed through
// checkpoint.buffer_mb of host memory (NOTE [Streaming checkpoints] in ckpt/checkpoint_stream.h).
// NOTE [Exact resume] in train/trainer.h says why this state is enough.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <yaml-cpp/yaml.h>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_stream.h"
#include "ckpt/initial_load.h"
#include "core/log.h"
#include "train/checkpoint_save_job.h"
#include "train/trainer.h"

namespace forge {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double mib(double bytes) { return bytes / 1048576.0; }

// Tensors laid end to end from flat element 0 (AdamW's moments are per parameter, in
// parameter order: their concatenation is the flat layout of the checkpoint).
std::vector<FlatSegment> consecutive(const std::vector<Tensor>& tensors) {
  std::vector<FlatSegment> segments;
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    segments.push_back({offset, t.view({t.numel()})});
    offset += t.numel();
  }
  return segments;
}

// NOTE [Pipeline parallelism]: a pipeline rank's parameters at their places in the whole
// model's flat layout (parameter_specs order), so every rank writes its own into one file
// and any layout reads them back.
// Under tensor parallelism: in the tensor-parallel rank's index space (its shards one after
// the other, NOTE [Tensor-parallel checkpoints]).
std::vector<FlatSegment> at_model_offsets(const ModelConfig& model, TensorParallelShard shard,
                                          const std::vector<ParamSpec>& specs, const std::vector<Tensor>& tensors) {
  std::map<std::string, int64_t> offset_of;
  int64_t offset = 0;
  for (const ParamSpec& spec : parameter_specs(model, shard)) {
    offset_of[spec.name] = offset;
    offset += shape_numel(spec.shape);
  }
  std::vector<FlatSegment> out;
  for (size_t i = 0; i < specs.size(); ++i)
    out.push_back({offset_of.at(specs[i].name), tensors[i].view({tensors[i].numel()})});
  return out;
}

// The same offsets with other tensors (FSDP: the moments beside the master segments).
std::vector<FlatSegment> at_offsets(const std::vector<FlatSegment>& like, const std::vector<Tensor>& tensors) {
  std::vector<FlatSegment> segments;
  for (size_t i = 0; i < like.size(); ++i) segments.push_back({like[i].flat_offset, tensors[i].view({tensors[i].numel()})});
  return segments;
}

// Bytes the kernel says a new allocation can take without swapping (MemAvailable); -1
// when unknown.
int64_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return -1;
}

// The process's peak resident memory (VmHWM) and its reset to the current resident size
// (Linux's clear_refs): the host memory a synchronous save adds is the peak after it less
// the resident size before it.
bool reset_host_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}
int64_t host_status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with(field)) return std::atoll(line.c_str() + std::strlen(field)) * 1024;
  return -1;
}

}  // namespace

void CheckpointSaveJob::start(StateSegments segments, bool background) {
  auto write_all = [this, segments = std::move(segments)] {
    try {
      if (snapshot_ready) writer->after(*snapshot_ready);
      for (FlatState s : kFlatStates)
        for (const FlatSegment& segment : segments[static_cast<size_t>(s)]) writer->write(s, segment);
      crcs = writer->finish();
    } catch (...) {
      error = std::current_exception();
    }
  };
  if (!background) return write_all();
  const int device = current_device_index();
  thread = std::thread([write_all = std::move(write_all), device]() mutable {
    set_current_device_index(device);
    write_all();
  });
}

void CheckpointSaveJob::wait() {
  if (thread.joinable()) thread.join();
}

CheckpointSaveJob::~CheckpointSaveJob() { wait(); }

std::string Trainer::checkpoint_folder() const {
  const std::string& folder = config_.checkpoint.folder;
  if (std::filesystem::path(folder).is_absolute()) return folder;
  return run_dir_ + "/" + folder;
}

size_t Trainer::checkpoint_buffer_bytes() const {
  return static_cast<size_t>(config_.checkpoint.buffer_mb) << 20;
}

std::array<std::vector<FlatSegment>, 3> Trainer::checkpoint_segments() const {
  StateSegments segments;
  auto& [params, m, v] = segments;
  if (lora_) {
    params = consecutive(lora_->masters());  // NOTE [LoRA checkpoints]; whole on every rank under data parallelism
  } else if (fsdp_) {
    const std::vector<FsdpSegment>& layout = fsdp_->layout().segments();
    for (size_t i = 0; i < layout.size(); ++i)
      params.push_back({layout[i].flat_offset, fsdp_->master_segments()[i].view({layout[i].numel})});
  } else if (pipeline_) {
    params = at_model_offsets(config_.model, tensor_parallel_shard_, params_->specs(), params_->tensors());
  } else {
    params = consecutive(params_->tensors());
  }
  const std::vector<FlatSegment> offsets =
      sharded_gradients() || pipeline_ ? params : consecutive(trainable_weights());
  m = at_offsets(offsets, optimizer_->exp_avg());
  v = at_offsets(offsets, optimizer_->exp_avg_sq());
  return segments;
}

std::optional<ShardPlacement> Trainer::tensor_parallel_placement() const {
  // LoRA's checkpoints hold the whole adapters (NOTE [LoRA under context and tensor parallelism]).
  if (!tensor_parallel_ || lora_) return std::nullopt;
  return ShardPlacement(parameter_specs(config_.model), tensor_parallel_shard_);
}

StateSegments Trainer::checkpoint_segments_to_save() const {
  StateSegments segments = checkpoint_segments();
  const std::optional<ShardPlacement> placement = tensor_parallel_placement();
  if (!placement || tensor_parallel_shard_.rank == 0) return segments;
  // NOTE [Tensor-parallel checkpoints]: the replicated parameters are tensor-parallel rank 0's to write.
  for (std::vector<FlatSegment>& of_state : segments)
    std::erase_if(of_state, [&](const FlatSegment& segment) {
      return segment.data.numel() > 0 && placement->replicated(segment.flat_offset);
    });
  return segments;
}

// Every tensor is read straight into place through the buffer; the weights the model
// computes with are then refreshed from the fp32 ones. Returns what the load staged on the
// host, for the log.
std::string Trainer::read_checkpoint_state(const Checkpoint& ck, bool with_optimizer) {
  return read_checkpoint_state(ck, with_optimizer, checkpoint_segments());
}

std::string Trainer::read_checkpoint_state(const Checkpoint& ck, bool with_optimizer, const StateSegments& segments) {
  const int64_t resident_before = reset_host_peak() ? host_status_bytes("VmRSS:") : -1;
  int64_t largest_piece = 1024;  // bytes: a buffer that holds the largest piece twice is large enough
  for (const TensorRecord& rec : ck.metadata.tensors)
    for (const TensorPiece& p : rec.pieces) largest_piece = std::max(largest_piece, p.byte_length);
  size_t staging = 0;
  {
    // Under tensor parallelism the segments are in this rank's index space, its shards: each
    // is read from wherever its whole tensors' elements are (NOTE [Tensor-parallel checkpoints]).
    const std::optional<ShardPlacement> placement = tensor_parallel_placement();
    ShardFileReader reader(ck, std::min(checkpoint_buffer_bytes(), static_cast<size_t>(largest_piece) * 2));
    staging = reader.staging_bytes();
    for (FlatState s : kFlatStates) {
      if (s != FlatState::Param && !with_optimizer) continue;
      for (const FlatSegment& segment : segments[static_cast<size_t>(s)]) {
        if (placement) reader.read(s, segment.data, placement->image(segment.flat_offset, segment.data.numel()));
        else reader.read(s, segment);
      }
    }
  }
  std::string how = fmt::format("peak host staging {:.1f} MiB", mib(static_cast<double>(staging)));
  if (resident_before >= 0)
    how += fmt::format(", process peak resident memory +{:.1f} MiB",
                       mib(static_cast<double>(host_status_bytes("VmHWM:") - resident_before)));
  if (lora_) lora_->refresh_compute();
  else if (fsdp_) fsdp_->refresh_compute_weights(false);
  else if (compute_weights_) compute_weights_->assign_from(*params_);
  return how;
}

void Trainer::restore_checkpoint(const std::string& dir) {
  Checkpoint ck = open_checkpoint(dir);
  check_checkpoint_model(ck, config_.model, checkpoint_specs(), /*same_architecture=*/true);
  const TrainingState& saved = ck.metadata.training;
  const int world = ck.metadata.files();
  // Each rank reads its segments, whatever world size saved the checkpoint.
  const std::string staged = read_checkpoint_state(ck, /*with_optimizer=*/true);
  optimizer_->set_step_count(saved.optimizer_step);
  train_loader_->set_position(saved.data_position);
  start_step_ = saved.step;
  // NOTE [Loss spikes]: a checkpoint from before the detector has no window: it fills again.
  loss_spike_.restore(saved.recent_losses);
  // NOTE [FP8 step end]: delayed scaling goes on from the saved histories; a checkpoint of
  // another run (bf16, tensorwise) has none, and the first step uses current scales again.
  if (fp8_ && config_.precision.fp8 == "delayed") {
    if (saved.fp8_delayed) {
      try {
        fp8_->restore_delayed_state(*saved.fp8_delayed);
      } catch (const Error& e) {
        FORGE_FAIL("checkpoint '{}': its FP8 delayed-scaling state does not fit this run: {}", dir, e.what());
      }
    } else if (saved.step > 0) {
      log_info("the checkpoint holds no FP8 amax histories (saved by a run without precision.fp8 delayed): the "
               "histories start empty and the first step uses current scales");
    }
  }
  if (loss_spike_.enabled() && saved.recent_losses.empty() && saved.step > 0)
    log_info("the checkpoint holds no recent losses for training.loss_spike_factor: spike detection starts after {} "
             "more steps",
             std::min(config_.training.loss_spike_window, kLossSpikeWarmup));
  log_info("resuming from checkpoint '{}' at step {} (saved by {} rank{}{}; data position {}; {})", dir, saved.step,
           world, world == 1 ? "" : "s",
           ck.metadata.tensor_parallel > 1 ? fmt::format(", tensor-parallel degree {}", ck.metadata.tensor_parallel) : "",
           saved.data_position, staged);
  if (saved.seed != config_.training.seed)
    log_warn("the checkpoint was saved with training.seed {}, this run has {}: the data order differs from the "
             "saved run's",
             saved.seed, config_.training.seed);
  if (lora_) {
    // Adapters trained on an NF4 base continue on a bf16 one (or the reverse), or with another
    // alpha or dropout, only when asked: each difference is said. (Another rank or target
    // list changes the adapters' shapes: check_checkpoint_model refuses that.)
    std::string saved_base = "none";
    std::optional<double> saved_alpha, saved_dropout;
    try {
      const YAML::Node lora = YAML::Load(ck.metadata.experiment_yaml)["lora"];
      if (lora && lora["quantize_base"]) saved_base = lora["quantize_base"].as<std::string>();
      if (lora && lora["alpha"]) saved_alpha = lora["alpha"].as<double>();
      if (lora && lora["dropout"]) saved_dropout = lora["dropout"].as<double>();
    } catch (const YAML::Exception&) {
      saved_base = "unknown";
    }
    if (saved_base != config_.lora.quantize_base)
      log_warn("the checkpoint's adapters were trained with lora.quantize_base {}, this run has {}: they continue on "
               "a base {} NF4",
               saved_base, config_.lora.quantize_base, config_.lora.quantize_base == "nf4" ? "quantized to" : "not in");
    if (saved_alpha && *saved_alpha != config_.lora.alpha)
      log_warn("the checkpoint's adapters were trained with lora.alpha {}, this run has {}: their update B A is scaled "
               "by alpha / rank = {} from now on (it was {})",
               *saved_alpha, config_.lora.alpha, config_.lora.alpha / static_cast<double>(config_.lora.rank),
               *saved_alpha / static_cast<double>(config_.lora.rank));
    if (saved_dropout && *saved_dropout != config_.lora.dropout)
      log_warn("the checkpoint's adapters were trained with lora.dropout {}, this run has {}", *saved_dropout,
               config_.lora.dropout);
  }
  if (saved.lr_schedule_steps != config_.training.steps)
    log_info("the LR schedule now spans training.steps = {} (the checkpoint's run had {})", config_.training.steps,
             saved.lr_schedule_steps);
}

void Trainer::load_initial_weights(const std::string& path) {
  if (config_.checkpoint.initial_load_in_hf) return load_initial_hf_weights(path);
  if (classify_initial_load(path, "checkpoint.initial_load_path") == InitialLoadKind::HuggingFace)
    FORGE_FAIL("checkpoint.initial_load_path '{}' is a Hugging Face model directory, but "
               "checkpoint.initial_load_in_hf is false",
               path);
  std::string dir = path;
  if (!std::filesystem::exists(path + "/metadata.json")) {
    const std::vector<int64_t> steps = checkpoint_steps(path);
    if (!steps.empty()) dir = checkpoint_dir(path, steps.back());
  }
  Checkpoint ck = open_checkpoint(dir);
  check_checkpoint_model(ck, config_.model, /*same_architecture=*/false);
  std::string staged;
  if (lora_) {
    // The frozen base (NOTE [LoRA training]) from a full checkpoint, through fp32 host memory;
    // a pipeline rank reads its stages' parameters alone (NOTE [LoRA under pipeline parallelism]).
    FlatParameters host(config_.model, Device::CPU, DType::F32, TensorParallelShard{}, pipeline_stages_);
    const std::vector<FlatSegment> places =
        pipeline_ ? at_model_offsets(config_.model, TensorParallelShard{}, host.specs(), host.tensors())
                  : std::vector<FlatSegment>{{0, host.flat()}};
    staged = read_checkpoint_state(ck, /*with_optimizer=*/false, StateSegments{{places, {}, {}}});
    std::optional<FlatParameters> shards;  // the rank's, under tensor parallelism (NOTE [Tensor-parallel shards])
    if (tensor_parallel_) {
      shards.emplace(config_.model, Device::CPU, DType::F32, tensor_parallel_shard_, pipeline_stages_);
      for (size_t k = 0; k < host.specs().size(); ++k)
        for (const ShardRun& run : tensor_parallel_runs(host.specs()[k], tensor_parallel_shard_))
          std::copy_n(host.tensors()[k].data<float>() + run.full_begin, run.count,
                      shards->tensors()[k].data<float>() + run.local_begin);
    }
    const FlatParameters& mine = shards ? *shards : host;
    if (fsdp_) load_fsdp_chunks(mine);  // NOTE [LoRA under data parallelism]
    else params_->assign_from(mine);
  } else {
    // Each rank reads only its segments, whatever world size saved the checkpoint.
    staged = read_checkpoint_state(ck, /*with_optimizer=*/false);
  }
  log_info("initial weights from checkpoint '{}' (checkpoint.initial_load_path; saved at step {}; {}); the "
           "optimizer and data start fresh at step 0",
           dir, ck.metadata.training.step, staged);
}

// NOTE [Parallel checkpoint saves]
// (A LoRA run under data parallelism saves its replicated adapters from rank 0 alone.)
// Under FSDP every rank of the first replica (the shard group that holds world rank 0)
// writes its own segments (NOTE [FSDP layout]: its chunk of every unit, the master weights
// and both moments) straight into the shard files, at the places their flat elements have
// there, through its bounded buffer (NOTE [Streaming checkpoints]): no rank gathers
// anything, and every rank writes at once. The checkpoint's ranks are the shard ranks:
// file r holds the flat range shard_ranges(numel, shards)[r], written by every rank whose
// chunks overlap it. Under tensor parallelism every tensor-parallel rank of that replica
// does the same in its own index space and files, the replicated parameters left to rank 0
// (NOTE [Tensor-parallel checkpoints] in ckpt/checkpoint_layout.h). Under pipeline
// parallelism the checkpoint is format 1's one file, every pipeline rank writing its
// stages' parameters and moments at their places in it. Rank 0 makes the
// temporary directory (named with its pid, which every rank learns through an all-reduce)
// and the shard files at their full size; every writer writes and fsyncs; the ranks (all of
// them, tensor-parallel ones included) all-gather the CRC-32s of the runs they wrote, and
// rank 0 combines them into each piece's, writes the metadata and renames the directory
// into place (NOTE [Atomic checkpoints]). The ranks must see one filesystem (one node, or
// a shared one across nodes), as with torch.distributed.checkpoint.
//
// NOTE [Async checkpoints]
// With checkpoint.async_mode: async (torchtitan's name) a save stalls the step loop only
// for a copy of this rank's state (its segments, in their dtypes: fp32 weights, fp32 or
// bf16 moments): into spare GPU memory when the free memory holds it with 1 GiB (and 5%
// of the GPU) to spare, else into host memory when MemAvailable holds it with 2 GiB to
// spare, else this rank writes from the live state before the step loop goes on, with a
// warning giving the sizes (its completion is still deferred, as every rank's is). A writer thread
// then streams the copy to the shard files while training goes on. The collective parts
// of a save (the pid all-reduce, the barriers, the CRC all-gather) run on the training
// thread only, never on the writer thread, so they never run beside the step's
// collectives on one communicator: the start (directory, files, barrier) happens before
// the snapshot, and the completion (join the writer, exchange the CRCs and whether every
// rank wrote its part, rank 0's metadata and rename, a barrier) at the next
// synchronisation point: the next save, or the end of the run (before the Hugging Face
// export). So a save waits for the one before it (one writer per directory), an error of
// the writer thread surfaces there naming the checkpoint, and the checkpoint appears on
// disk only then: a run killed before that point resumes from the one before, as a
// synchronous save killed halfway would.
void Trainer::save_checkpoint(int64_t step) {
  finish_checkpoint_save_job();
  if (lora_) save_peft_adapter_to_run_dir();  // the adapters of this step, in PEFT's format
  const auto t0 = std::chrono::steady_clock::now();
  auto job = std::make_unique<CheckpointSaveJob>();
  job->started = t0;
  TrainingState& state = job->state;
  state.step = step;
  state.data_position = train_loader_->position();
  state.seed = config_.training.seed;
  state.lr_schedule_steps = config_.training.steps;
  state.optimizer = config_.optimizer;
  state.optimizer_step = optimizer_->step_count();
  state.recent_losses = loss_spike_.recent();  // NOTE [Loss spikes]
  if (fp8_ && config_.precision.fp8 == "delayed") state.fp8_delayed = fp8_->delayed_state();  // NOTE [FP8 step end]
  const std::string folder = checkpoint_folder();
  job->dir = checkpoint_dir(folder, step);
  // LoRA's adapters are whole on every rank: one shard, written by rank 0. Under tensor
  // parallelism each tensor-parallel rank's shard ranks write its own files.
  const int shards = sharded_gradients() ? shard_group_->world_size() : 1;
  job->layout = lora_ ? checkpoint_layout(checkpoint_specs(), shard_ranges(lora_->stored_values(), 1))
                      : tensor_parallel_checkpoint_layout(config_.model, tensor_parallel_shard_.size, shards);
  DataParallelComm* comm = checkpoint_comm();
  const int64_t token =
      comm ? std::llround(comm->sum_over_ranks(rank_ == 0 ? static_cast<double>(::getpid()) : 0.0)) : ::getpid();
  if (rank_ == 0) {
    job->staging.emplace(begin_checkpoint_save(folder, step, token));
    create_checkpoint_shard_files(job->staging->temporary_path(), job->layout.file_numel);
  }
  if (world_) world_->barrier();
  // The replica of world rank 0 (consecutive data-parallel ranks shard), every tensor-parallel rank of it;
  // LoRA's adapters, the same on every rank, rank 0 alone.
  const bool writer = lora_ ? rank_ == 0 : data_rank_ < shards;
  const bool async_mode = config_.checkpoint.async_mode == "async";
  // A synchronous save measures what the process's peak resident memory rises by, its
  // buffer included (pinned memory is resident from its allocation on).
  if (writer && !async_mode && reset_host_peak()) job->host_resident_before = host_status_bytes("VmRSS:");
  if (writer) {
    StateSegments segments = checkpoint_segments_to_save();
    int64_t elements = 0;  // a buffer that holds all of them twice over is large enough
    for (const auto& of_state : segments)
      for (const FlatSegment& segment : of_state) elements += segment.data.numel();
    const size_t buffer = std::min(checkpoint_buffer_bytes(), static_cast<size_t>(std::max<int64_t>(elements, 1024)) * 8);
    job->writer = std::make_unique<ShardFileWriter>(checkpoint_temporary_dir(folder, step, token), job->layout,
                                                    tensor_parallel_shard_.rank, buffer);
    bool async = false;
    if (async_mode) {
      try {
        async = snapshot(*job, segments);
      } catch (const OutOfMemoryError& e) {
        log_warn("checkpoint.async_mode async: no room for the snapshot of step {} ({}); it is saved synchronously",
                 step, e.what());
        job->snapshot = {};
        segments = checkpoint_segments_to_save();
      }
    }
    if (!async) {
      job->snapshot_ready = std::make_unique<DeviceEvent>(device_);
      job->snapshot_ready->record(nullptr);  // the writer's copies start after the step's kernels
    }
    job->start(std::move(segments), async);
    job->stall_seconds = seconds_since(t0);
  }
  checkpoint_job_ = std::move(job);
  // Every rank defers the completion in async mode, whether its snapshot fitted or not, so
  // that all ranks run its collectives at the same point.
  if (!async_mode) finish_checkpoint_save_job();
}

bool Trainer::snapshot(CheckpointSaveJob& job, StateSegments& segments) {
  std::array<int64_t, 3> bytes{};
  for (size_t s = 0; s < 3; ++s)
    for (const FlatSegment& segment : segments[s]) bytes[s] += static_cast<int64_t>(segment.data.nbytes());
  const int64_t total = bytes[0] + bytes[1] + bytes[2];
  Device place = Device::CPU;
  const int64_t host_free = host_memory_available();
  if (device_ == Device::CUDA) {
    const DeviceMemoryInfo info = device_memory_info();
    const int64_t margin = std::max<int64_t>(int64_t{1} << 30, static_cast<int64_t>(info.total / 20));
    if (total + margin <= static_cast<int64_t>(info.free)) place = Device::CUDA;
  }
  if (place == Device::CPU && (host_free < 0 || total + (int64_t{2} << 30) > host_free)) {
    log_warn("checkpoint.async_mode async: a snapshot of this rank's state takes {:.2f} GiB, more than spare GPU "
             "memory or available host memory ({:.2f} GiB) hold; step {} is saved synchronously",
             total / 1073741824.0, host_free / 1073741824.0, job.state.step);
    return false;
  }
  for (size_t s = 0; s < 3; ++s) {
    if (segments[s].empty()) continue;
    // One buffer per vector (the segments of a vector share its dtype), the segments copied into it.
    const DType dtype = segments[s].front().data.dtype();
    job.snapshot[s] = Tensor::empty({bytes[s] / static_cast<int64_t>(dtype_size(dtype))}, dtype, place);
    int64_t at = 0;
    for (FlatSegment& segment : segments[s]) {
      FORGE_CHECK(segment.data.dtype() == dtype, "checkpoint snapshot: mixed dtypes in one vector");
      const Tensor copy = job.snapshot[s].narrow(at, at + segment.data.numel());
      copy.copy_from(segment.data);
      segment.data = copy;
      at += segment.data.numel();
    }
  }
  job.snapshot_ready = std::make_unique<DeviceEvent>(place);
  job.snapshot_ready->record(nullptr);
  job.snapshot_place = place == Device::CUDA ? "GPU memory" : "host memory";
  job.snapshot_bytes = static_cast<size_t>(total);
  return true;
}

void Trainer::finish_checkpoint_save_job() {
  if (!checkpoint_job_) return;
  std::unique_ptr<CheckpointSaveJob> job = std::move(checkpoint_job_);
  job->wait();
  // A synchronous save: what the process's resident memory rose by while it wrote.
  const int64_t host_growth =
      job->host_resident_before >= 0 ? host_status_bytes("VmHWM:") - job->host_resident_before : -1;
  std::string failure;
  if (job->error) {
    try {
      std::rethrow_exception(job->error);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  const size_t staging = job->writer ? job->writer->staging_bytes() : 0;
  job->writer.reset();  // its buffer and files are released before the rename
  const std::string what = fmt::format("checkpoint '{}' (step {})", job->dir, job->state.step);
  std::vector<PieceCrc> parts = std::move(job->crcs);
  if (DataParallelComm* comm = checkpoint_comm()) {
    // Whether every writer wrote its part, then everyone's CRC-32s, on the training thread
    // (NOTE [Async checkpoints]).
    const double failed = comm->sum_over_ranks(failure.empty() ? 0.0 : 1.0);
    if (!failure.empty()) FORGE_FAIL("{} could not be written by rank {}: {}", what, rank_, failure);
    if (failed > 0)
      FORGE_FAIL("{} could not be written: {} rank(s) failed to write their part (their logs say why)", what,
                 std::llround(failed));
    const std::vector<uint32_t> counts = comm->all_gather_words({static_cast<uint32_t>(parts.size())});
    const uint32_t longest = *std::max_element(counts.begin(), counts.end());
    std::vector<uint32_t> words = encode_piece_crcs(parts);
    words.resize(static_cast<size_t>(longest) * kPieceCrcWords, 0);
    const std::vector<uint32_t> all = comm->all_gather_words(words);
    parts.clear();
    for (size_t r = 0; r < counts.size(); ++r) {
      const std::vector<PieceCrc> theirs =
          decode_piece_crcs(all.data() + r * longest * kPieceCrcWords, counts[r]);
      parts.insert(parts.end(), theirs.begin(), theirs.end());
    }
  } else if (!failure.empty()) {
    FORGE_FAIL("{} could not be written: {}", what, failure);
  }
  if (rank_ == 0)
    finish_checkpoint_save(checkpoint_folder(), *job->staging, config_.model, checkpoint_specs(), resolved_yaml_,
                           job->state, job->layout, combine_piece_crcs(job->layout.pieces, std::move(parts)),
                           config_.checkpoint.keep_latest_k);
  if (world_) world_->barrier();  // the checkpoint is in place before any rank goes on
  if (rank_ != 0) return;
  double bytes = 0;
  for (int64_t n : job->layout.file_numel) bytes += 12.0 * static_cast<double>(n);
  std::string how = fmt::format("peak host staging {:.1f} MiB", mib(static_cast<double>(staging)));
  if (host_growth >= 0) how += fmt::format(", process peak resident memory +{:.1f} MiB", mib(static_cast<double>(host_growth)));
  if (!job->snapshot_place.empty())
    how = fmt::format("asynchronous: the step loop waited {:.2f} s for a {:.2f} GiB snapshot in {}; {}",
                      job->stall_seconds, job->snapshot_bytes / 1073741824.0, job->snapshot_place, how);
  log_info("saved checkpoint '{}' ({:.1f} MB in {:.2f} s; {})", job->dir, bytes / 1e6, seconds_since(job->started),
           how);
}

}  // namespace forge
