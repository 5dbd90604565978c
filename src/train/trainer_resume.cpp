// Which checkpoint a run resumes from.
//
// NOTE [Choosing the checkpoint to resume]
// With checkpoint.load_step -1 a run resumes from the newest checkpoint that is whole: its
// metadata reads and agrees with the directory name (step-<N> holds step N), every shard
// file is there with the size the metadata implies, and every piece of every shard file
// has the CRC-32 the metadata recorded. A checkpoint that fails any of these is reported
// (a warning naming the file and the tensor) and the one before it is tried; nothing is
// deleted or written over (the next save of that step replaces it only once it is complete,
// NOTE [Atomic checkpoints]). A checkpoint saved for another model is not damage: it stops
// the run as before. When every checkpoint is damaged the run stops, listing them.
// Cost: checking the CRCs reads every shard file once before the load reads them again.
// The ranks split it (piece i is read by rank i mod world), so each rank reads 1/world of
// the checkpoint, and one all-reduce per candidate makes every rank take the same one.
// An explicit checkpoint.load_step is checked the same way, but a damaged one is an error.
#include <chrono>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/log.h"
#include "train/trainer.h"

namespace forge {

// Empty when the checkpoint is whole on every rank; otherwise this rank's finding (or a
// note that another rank found damage).
std::string Trainer::checkpoint_problem(const std::string& dir) {
  std::string problem;
  std::optional<Checkpoint> ck;
  try {
    ck = open_checkpoint(dir);
  } catch (const Error& e) {
    problem = e.what();
  }
  // Another model's checkpoint is a configuration mistake, not damage: never skipped.
  if (ck) check_checkpoint_model(*ck, config_.model, checkpoint_specs(), /*same_architecture=*/true);
  if (ck) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      verify_checkpoint_pieces(*ck, rank_, world_size_);
      const double bytes = 3.0 * 4.0 * static_cast<double>(ck->metadata.flat_numel) / world_size_;
      log_info("checked the CRC-32s of '{}' ({:.1f} MB{}) in {:.2f} s", dir, bytes / 1e6,
               world_size_ > 1 ? " read by this rank" : "",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    } catch (const Error& e) {
      problem = e.what();
    }
  }
  // Said now, before the ranks agree: a rank that learns of it from this one may exit, and
  // its exit stop this process (NOTE [Failure detection]), before this rank's own error is
  // printed.
  if (!problem.empty() && world_size_ > 1) log_warn("rank {} found checkpoint '{}' damaged: {}", rank_, dir, problem);
  DataParallelComm* comm = checkpoint_comm();
  const bool anywhere = comm ? comm->sum_over_ranks(problem.empty() ? 0.0 : 1.0) > 0 : !problem.empty();
  if (anywhere && problem.empty()) problem = "another rank found it damaged (see its message)";
  return problem;
}

std::optional<std::string> Trainer::choose_checkpoint() {
  const std::string folder = checkpoint_folder();
  const int64_t load_step = config_.checkpoint.load_step;
  if (load_step >= 0) {
    const std::string dir = *find_checkpoint(folder, load_step);
    const std::string problem = checkpoint_problem(dir);
    if (!problem.empty()) FORGE_FAIL("checkpoint.load_step {}: {}", load_step, problem);
    return dir;
  }
  const std::vector<int64_t> steps = checkpoint_steps(folder);
  std::vector<std::string> rejected;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string dir = checkpoint_dir(folder, *it);
    const std::string problem = checkpoint_problem(dir);
    if (problem.empty()) {
      if (!rejected.empty())
        log_warn("resuming from '{}', the newest whole checkpoint ({} newer one{} left as {} for inspection)", dir,
                 rejected.size(), rejected.size() == 1 ? "" : "s", rejected.size() == 1 ? "it is" : "they are");
      return dir;
    }
    log_warn("checkpoint '{}' cannot be resumed from: {}; trying the one before it", dir, problem);
    rejected.push_back(dir);
  }
  if (!rejected.empty())
    FORGE_FAIL("no checkpoint in '{}' can be resumed from: all {} are damaged (see the warnings above); move them "
               "away to start the run afresh",
               folder, rejected.size());
  return std::nullopt;
}

}  // namespace forge
