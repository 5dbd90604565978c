// The trainer's side of FP8 training under data parallelism: what the ranks must agree on at
// a step's end so that their FP8 state stays one.
//
// NOTE [FP8 under data parallelism]
// Under FSDP (full training, or LoRA over FSDP's frozen base: NOTE [FP8 frozen base];
// parallelism.data_parallel_shard_degree × replicate_degree > 1)
// the Fp8Projections wrap the Fsdp as they wrap the flat weights on one device (NOTE [FP8
// projections]): every rank quantizes the full bf16 weights its gathers hand out, its own
// micro-batches' activations and gradients, with the same recipe. Three things must agree
// across the ranks, and the collectives for them run here (model/ knows no process group):
//  - A non-finite amax (NOTE [FP8 step end]) on one rank is a non-finite step on every rank:
//    each rank counts whether it saw one in the step's loss all-reduce (a third value beside
//    the loss and the stop flag, no collective of its own), so every rank skips or stops the
//    same step. When any did, the ranks all-gather their first (slot and amax) over the
//    shard group and every rank names the same one: the first in parameter order, and the
//    rank that saw it ("... amax nan (data-parallel rank 1; 1 of 2 ranks saw one)"). A rank
//    of another replica that alone saw one is named by its own shard group, the others say
//    that another replica saw it.
//  - delayed: the step's `seen` amaxes are max-all-reduced over every data-parallel rank
//    before end_step folds them into the histories, as Transformer Engine reduces its amaxes
//    over the FP8 group: the histories, and so the scales, are then the one-device run's
//    over the same global batch (the maximum over all its micro-batches), identical on every
//    rank. The whole statistics array is reduced in one all-reduce (the scales in it are
//    equal on every rank, and the maximum keeps them): 2.25 KiB per projection, 288 KiB for
//    the 8B's 128 projections, once per optimizer step. Skipped steps drop their amaxes
//    unreduced. Since every rank's state is the same, rank 0's checkpoint holds it (saved as
//    on one device) and every rank restores it from there, at any world size.
//  - tensorwise: nothing: a weight's scale comes from the full gathered weight (the same on
//    every rank), an activation's or gradient's from the micro-batch at hand, as on one
//    device reading that micro-batch.
// The weight cache (NOTE [FP8 weight cache]) holds codes per projection, keyed by the
// weight's data pointer within a step: under ZeRO-3 a block's gathered weights sit in one of
// three rotating buffers, so a projection sees its own weight at whichever buffer the gather
// used (a changed pointer recasts), never another layer's (each layer has its own
// projections and caches); GpuFsdp.Fp8WeightCacheUnderZero3 checks the cached run bitwise
// against the uncached one. The cache holds every FP8 weight in full (2 bytes each, not
// sharded), which ZeRO-3 runs of large models will want off. With the FP8 all-gather (NOTE
// [FP8 all-gather] in distributed/fsdp.h) a tensorwise weight's amax is max-reduced at each
// gather instead, and a delayed weight's W record holds this rank's chunk's amax until the
// step-end all-reduce above makes it the whole weight's.
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "train/trainer.h"

namespace forge {

std::string Trainer::describe_nonfinite_amax(const Fp8Projections::NonfiniteAmax& own, int64_t ranks) {
  if (!dp_) return fp8_->describe(own);
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  uint32_t bits = 0;
  std::memcpy(&bits, &own.amax, sizeof bits);
  const std::vector<uint32_t> all =
      dp_->all_gather_words({own.slot < 0 ? kNone : static_cast<uint32_t>(own.slot), bits});
  auto slot_of = [&](int r) { return all[2 * static_cast<size_t>(r)]; };
  int first = -1;  // the shard rank whose slot comes first
  for (int r = 0; r < static_cast<int>(all.size() / 2); ++r)
    if (slot_of(r) != kNone && (first < 0 || slot_of(r) < slot_of(first))) first = r;
  const std::string seen_by = fmt::format("{} of {} ranks saw one", ranks, world_size_);
  if (first < 0) return fmt::format("on a data-parallel rank of another replica ({})", seen_by);
  Fp8Projections::NonfiniteAmax found{slot_of(first), 0.0f};
  std::memcpy(&found.amax, &all[2 * static_cast<size_t>(first) + 1], sizeof found.amax);
  // Consecutive world ranks form a shard group (Trainer::set_up_data_parallel).
  const int world_rank = rank_ - shard_group_->rank() + first;
  return fmt::format("{} (data-parallel rank {}; {})", fp8_->describe(found), world_rank, seen_by);
}

void Trainer::end_fp8_step(bool update) {
  if (dp_ && update && fp8_->delayed()) dp_->all_reduce_max(fp8_->statistics());
  fp8_->end_step(update);
}

}  // namespace forge
