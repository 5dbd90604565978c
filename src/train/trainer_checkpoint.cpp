// The trainer's side of checkpoints: which folder, what a save captures (world 1: one
// shard holding every flat range), and what a resume or a fine-tuning start restores.
// NOTE [Exact resume] in train/trainer.h says why this state is enough.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>

#include "ckpt/checkpoint.h"
#include "core/log.h"
#include "ops/elementwise.h"
#include "train/trainer.h"

namespace forge {
namespace {

// AdamW keeps a moment tensor per parameter, in parameter order: their concatenation is
// the flat layout of the checkpoint. Tensors may live on the GPU and moments may be bf16
// (NOTE [Optimizer state in bf16]): checkpoints always pass through host memory and always
// hold fp32, so a run can resume with either optimizer.state_dtype.
std::vector<float> concatenate(const std::vector<Tensor>& tensors) {
  std::vector<float> flat;
  for (const Tensor& t : tensors) {
    Tensor host = t.to(Device::CPU);
    if (host.dtype() != DType::F32) {
      Tensor wide = Tensor::empty(host.shape(), DType::F32);
      cast(wide, host);
      host = wide;
    }
    flat.insert(flat.end(), host.data<float>(), host.data<float>() + host.numel());
  }
  return flat;
}

void read_into_tensor(const Checkpoint& ck, FlatState state, int64_t offset, const Tensor& t) {
  const bool direct = t.device() == Device::CPU && t.dtype() == DType::F32;
  Tensor host = direct ? t : Tensor::empty(t.shape(), DType::F32);
  read_flat_range(ck, state, offset, std::span<float>(host.data<float>(), static_cast<size_t>(host.numel())));
  if (direct) return;
  if (t.dtype() == DType::F32) return t.copy_from(host);
  cast(t, host.to(t.device()));
}

void read_into_tensors(const Checkpoint& ck, FlatState state, const std::vector<Tensor>& tensors) {
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    read_into_tensor(ck, state, offset, t);
    offset += t.numel();
  }
}

}  // namespace

std::string Trainer::checkpoint_folder() const {
  const std::string& folder = config_.checkpoint.folder;
  if (std::filesystem::path(folder).is_absolute()) return folder;
  return run_dir_ + "/" + folder;
}

void Trainer::restore_checkpoint(const std::string& dir) {
  Checkpoint ck = open_checkpoint(dir);
  check_checkpoint_model(ck, config_.model, /*same_architecture=*/true);
  const TrainingState& saved = ck.metadata.training;
  const int world = static_cast<int>(ck.metadata.shards.size());
  if (fsdp_) {
    // Each rank reads its segments, whatever world size saved the checkpoint.
    fsdp_->load_master([&](int64_t offset, std::span<float> out) { read_flat_range(ck, FlatState::Param, offset, out); });
    const std::vector<FsdpSegment>& segments = fsdp_->layout().segments();
    for (size_t i = 0; i < segments.size(); ++i) {
      read_into_tensor(ck, FlatState::ExpAvg, segments[i].flat_offset, optimizer_->exp_avg()[i]);
      read_into_tensor(ck, FlatState::ExpAvgSq, segments[i].flat_offset, optimizer_->exp_avg_sq()[i]);
    }
  } else {
    read_into_tensor(ck, FlatState::Param, 0, params_->flat());
    if (compute_weights_) compute_weights_->assign_from(*params_);
    read_into_tensors(ck, FlatState::ExpAvg, optimizer_->exp_avg());
    read_into_tensors(ck, FlatState::ExpAvgSq, optimizer_->exp_avg_sq());
  }
  optimizer_->set_step_count(saved.optimizer_step);
  train_loader_->set_position(saved.data_position);
  start_step_ = saved.step;
  log_info("resuming from checkpoint '{}' at step {} (saved by {} rank{}; data position {})", dir, saved.step, world,
           world == 1 ? "" : "s", saved.data_position);
  if (saved.seed != config_.training.seed)
    log_warn("the checkpoint was saved with training.seed {}, this run has {}: the data order differs from the "
             "saved run's",
             saved.seed, config_.training.seed);
  if (saved.lr_schedule_steps != config_.training.steps)
    log_info("the LR schedule now spans training.steps = {} (the checkpoint's run had {})", config_.training.steps,
             saved.lr_schedule_steps);
}

void Trainer::load_initial_weights(const std::string& path) {
  if (config_.checkpoint.initial_load_in_hf) return load_initial_hf_weights(path);
  if (!std::filesystem::is_directory(path))
    FORGE_FAIL("checkpoint.initial_load_path '{}' is not a directory (expected a forge checkpoint, step-<N>, or a "
               "folder of them)",
               path);
  std::string dir = path;
  if (!std::filesystem::exists(path + "/metadata.json")) {
    const std::vector<int64_t> steps = checkpoint_steps(path);
    if (!steps.empty()) dir = checkpoint_dir(path, steps.back());
  }
  Checkpoint ck = open_checkpoint(dir);
  check_checkpoint_model(ck, config_.model, /*same_architecture=*/false);
  if (fsdp_) {
    // Each rank reads only its segments, whatever world size saved the checkpoint.
    fsdp_->load_master([&](int64_t offset, std::span<float> out) { read_flat_range(ck, FlatState::Param, offset, out); });
  } else {
    read_into_tensor(ck, FlatState::Param, 0, params_->flat());
    if (compute_weights_) compute_weights_->assign_from(*params_);
  }
  log_info("initial weights from checkpoint '{}' (checkpoint.initial_load_path; saved at step {}); the optimizer "
           "and data start fresh at step 0",
           dir, ck.metadata.training.step);
}

// NOTE [Parallel checkpoint saves]
// Under FSDP every rank of the first replica (the shard group that holds world rank 0)
// writes its own shard file at once: the checkpoint's ranks are the shard ranks, and rank
// r's file holds the contiguous flat range shard_ranges(numel, shards)[r] of the weights
// and both moments, which Fsdp::gather_flat_range moves there from the per-unit chunks
// (NOTE [FSDP layout]); every rank thus holds 12 bytes per parameter / shards in host
// memory, never the whole model. Rank 0 makes the temporary directory (named with its pid,
// which every rank learns through an all-reduce), every writer writes and fsyncs its file
// and hands rank 0 the CRC-32s of its pieces, and rank 0 writes the metadata and renames
// the directory into place (NOTE [Atomic checkpoints]). The ranks must see one filesystem
// (one node, or a shared one across nodes), as with torch.distributed.checkpoint.
void Trainer::save_checkpoint(int64_t step) {
  auto t0 = std::chrono::steady_clock::now();
  TrainingState state;
  state.step = step;
  state.data_position = train_loader_->position();
  state.seed = config_.training.seed;
  state.lr_schedule_steps = config_.training.steps;
  state.optimizer = config_.optimizer;
  state.optimizer_step = optimizer_->step_count();
  const int64_t numel = config_.model.total_params();
  std::string dir;
  if (fsdp_) {
    const int shards = shard_group_->world_size(), shard_rank = shard_group_->rank();
    const bool writer = rank_ < shards;  // the replica of world rank 0 (consecutive ranks shard)
    const std::vector<ShardRange> ranges = shard_ranges(numel, shards);
    const ShardRange mine = ranges[static_cast<size_t>(shard_rank)];
    std::vector<float> params(static_cast<size_t>(mine.size())), m(params.size()), v(params.size());
    fsdp_->gather_flat_range(fsdp_->master_segments(), mine.begin, mine.end, params);
    fsdp_->gather_flat_range(optimizer_->exp_avg(), mine.begin, mine.end, m);
    fsdp_->gather_flat_range(optimizer_->exp_avg_sq(), mine.begin, mine.end, v);
    const int64_t token = std::llround(fsdp_->sum_over_ranks(rank_ == 0 ? static_cast<double>(::getpid()) : 0.0));
    const std::string folder = checkpoint_folder();
    std::optional<AtomicDirectory> staging;
    if (rank_ == 0) staging.emplace(begin_checkpoint_save(folder, step, token));
    const std::string tmp = checkpoint_temporary_dir(folder, step, token);
    world_->barrier();
    std::vector<uint32_t> crcs;
    if (writer) crcs = write_checkpoint_shard(tmp, config_.model, ranges, shard_rank, {mine, params.data(), m.data(), v.data()});
    // Every shard group exchanges CRC lists padded to the longest; only the first one's count.
    const std::vector<int64_t> counts = checkpoint_piece_counts(config_.model, ranges);
    const int64_t longest = *std::max_element(counts.begin(), counts.end());
    std::vector<uint32_t> padded(static_cast<size_t>(longest), 0);
    std::copy(crcs.begin(), crcs.end(), padded.begin());
    const std::vector<uint32_t> all = fsdp_->all_gather_words(padded);
    if (rank_ == 0) {
      std::vector<std::vector<uint32_t>> by_rank;
      for (int r = 0; r < shards; ++r) {
        const auto first = all.begin() + static_cast<std::ptrdiff_t>(r * longest);
        by_rank.emplace_back(first, first + counts[static_cast<size_t>(r)]);
      }
      dir = finish_checkpoint_save(folder, *staging, config_.model, resolved_yaml_, state, ranges, by_rank,
                                   config_.checkpoint.keep_latest_k);
    }
    world_->barrier();  // the checkpoint is in place before any rank goes on
    if (rank_ != 0) return;
  } else {
    const std::vector<float> m = concatenate(optimizer_->exp_avg());
    const std::vector<float> v = concatenate(optimizer_->exp_avg_sq());
    const Tensor flat = params_->flat().to(Device::CPU);
    ShardData shard{shard_ranges(numel, 1).front(), flat.data<float>(), m.data(), v.data()};
    dir = forge::save_checkpoint(checkpoint_folder(), config_.model, resolved_yaml_, state, {shard},
                                 config_.checkpoint.keep_latest_k);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log_info("saved checkpoint '{}' ({:.1f} MB in {:.2f} s)", dir, 3.0 * 4.0 * static_cast<double>(numel) / 1e6,
           seconds);
}

}  // namespace forge
