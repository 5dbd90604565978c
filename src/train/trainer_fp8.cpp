// The trainer's side of FP8 training across ranks (data, context and pipeline parallelism):
// what the ranks must agree on at a step's end so that their FP8 state stays one.
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
// Under expert parallelism a rank casts its local routed experts alone, and the delayed
// max-reduction above fills the other experts' blocks from their ranks (NOTE [FP8 routed
// experts under expert parallelism] in ops/moe_fp8.h): the shard group holds every
// expert-parallel group.
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
//
// NOTE [FP8 under context and pipeline parallelism]
// Context parallelism (NOTE [Context-parallel steps] in train/trainer.cpp): the C ranks of
// a context-parallel group hold the same weights and different chunks of the same
// sequences, and FSDP shards over them as over data-parallel ranks, so the Fp8Projections
// wrap the Fsdp and everything above holds with the shard group counting the
// context-parallel ranks: a weight's tensorwise scale comes from the full gathered weight
// (the same on every rank of the group), a non-finite amax on any rank is a non-finite step
// on every rank, and with `delayed` the step's amaxes are max-reduced over the
// context-parallel ranks too (the maximum over the chunks is the whole sequence's), so the
// histories and scales are identical on every rank, and rank 0's checkpoint holds them. As
// Megatron-LM, which hands Transformer Engine an amax-reduction group of the tensor-, data-
// and context-parallel ranks for its delayed scaling. Current scaling of an activation or
// gradient (`tensorwise`, and a delayed run's first step) stays per rank: each rank scales
// x and dy by the amax of its own chunks, as each data-parallel rank scales its own
// micro-batch (TE's current scaling reduces an amax over a group for the inputs it
// all-gathers in FP8 under sequence parallelism; forge gathers no projection's input: the
// keys and values it gathers are attention's). So a context-parallel
// run is not bitwise one rank's over the whole sequence (a chunk's amax may be smaller than
// the sequence's, giving it a finer scale): it follows it within FP8's rounding.
// Pipeline parallelism (NOTE [Pipeline parallelism] in model/pipeline.h): each rank builds
// the projections of its stages alone (Fp8Projections hands out descriptors lazily, for the
// layers asked for), but its statistics array and histories have a block for every
// projection of the model, numbered in the whole model's parameter order: the blocks of
// other stages' projections see no cast, their `seen` stays 0. So the non-finite check
// names the first over the pipeline (each rank's first, agreed over its data-parallel
// ranks, then gathered over the pipeline group with the rank that saw it), the count of the
// ranks that saw one travels in the pipeline's loss all-reduce, and with `delayed` the
// statistics array is max-reduced over the pipeline group after the data-parallel
// reduction: each block then holds its owner stage's amaxes (0 elsewhere), the scales are
// equal everywhere already, and every rank updates every history alike, so every rank
// holds the whole model's delayed state (Megatron-LM reduces within a stage only and keeps
// each stage's histories on its ranks; the whole array on every rank costs one more
// all-reduce of 2.25 KiB per projection per step, and the histories 12 bytes x
// fp8_amax_history_len per projection, and gives checkpoints one state, rank 0's, that
// restores under any layout: one rank, another schedule or degree, FSDP).
//
// NOTE [FP8 under ZeRO-2 and -3 pipeline ranks]
// FSDP ZeRO-2 and -3 over a pipeline rank's stages (NOTE [ZeRO-2 and -3 under pipeline
// parallelism] in distributed/fsdp.h) need nothing more than the two notes above: the
// Fp8Projections wrap the Fsdp, a ZeRO-3 block's gathered weights reach them through the
// rotating slots as without pipelining (the weight cache keyed by pointer, NOTE [FP8 under
// data parallelism]), and the step end reduces the statistics over the shard group, then the
// pipeline. What differs from ZeRO-1 is the gradients' fp32 summation order: ZeRO-2 and -3
// reduce-scatter each micro-batch's gradients when its backward of a unit ends and add them
// into the chunk, where ZeRO-1 (and one rank) adds the rank's micro-batches first. A delayed
// run feeds step 3's weight and gradient amaxes into step 4's scales, so that reordering
// moves FP8 codes across rounding boundaries and the histories drift by more than fp32's
// rounding. Measured on CPU ranks (debug-tiny, 4 blocks, 4 micro-batches a step, history 8,
// tests/python/test_fp8_pipeline_zero.py): the step-4 histories of PP2 x FSDP2 under ZeRO-2
// and -3 are 2.3e-2 from one rank's (losses 1.1e-4, gradient norms 1.0e-2 over 8 steps),
// and so are plain FSDP2 ZeRO-3's, with no pipeline (2.3e-2; losses 1.1e-4, gradient norms
// 1.0e-2), while ZeRO-1 under the pipeline is one rank's bitwise at step 4. With the same
// order, the comparison is bitwise: PP2 x FSDP2 under ZeRO-2 (1F1B) and ZeRO-3 (1F1B and
// the interleaved schedule) equal plain FSDP2 ZeRO-3 in every loss, gradient norm, history
// and scale, tensorwise and delayed, and PP2 x CP2 under ZeRO-2 and -3 plain CP2 ZeRO-3 in
// every loss and history (the gradient norms within 3.4e-8: the pipeline all-reduces the
// stages' sums of squares). So the gap is the summation order's, not the pipeline's, and
// FP8 runs under ZeRO-2 and -3 pipeline ranks as under plain ZeRO-3 (tensorwise: losses
// 7.0e-6, gradient norms 1.5e-3 from one rank). LoRA's FP8 frozen base over ZeRO-3 stages
// is ZeRO-1's bitwise (the gathers copy the base, the adapters' gradients are summed as
// under ZeRO-1): losses 5.1e-8 and histories 1.1e-7 from one process.
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "train/trainer.h"

namespace forge {

std::string Trainer::describe_nonfinite_amax(const Fp8Projections::NonfiniteAmax& own, int64_t ranks) {
  if (!dp_ && !pipeline_comm_ && !tensor_parallel_comm_) return fp8_->describe(own);
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  auto words_of = [&](const Fp8Projections::NonfiniteAmax& found, int world_rank) {
    uint32_t bits = 0;
    std::memcpy(&bits, &found.amax, sizeof bits);
    return std::vector<uint32_t>{found.slot < 0 ? kNone : static_cast<uint32_t>(found.slot), bits,
                                 static_cast<uint32_t>(world_rank)};
  };
  // The entry of `all` (three words per rank) whose slot comes first in parameter order, or -1.
  auto first_of = [&](const std::vector<uint32_t>& all, Fp8Projections::NonfiniteAmax& found, int& world_rank) {
    int first = -1;
    for (int r = 0; r < static_cast<int>(all.size() / 3); ++r)
      if (all[3 * static_cast<size_t>(r)] != kNone &&
          (first < 0 || all[3 * static_cast<size_t>(r)] < all[3 * static_cast<size_t>(first)]))
        first = r;
    found = {};
    if (first < 0) return;
    found.slot = all[3 * static_cast<size_t>(first)];
    std::memcpy(&found.amax, &all[3 * static_cast<size_t>(first) + 1], sizeof found.amax);
    world_rank = static_cast<int>(all[3 * static_cast<size_t>(first) + 2]);
  };
  Fp8Projections::NonfiniteAmax found = own;
  int world_rank = rank_;
  if (dp_) first_of(dp_->all_gather_words(words_of(found, world_rank)), found, world_rank);  // the shard group
  if (pipeline_comm_) first_of(pipeline_comm_->all_gather_words(words_of(found, world_rank)), found, world_rank);
  if (tensor_parallel_comm_)  // NOTE [FP8 under tensor parallelism]
    first_of(tensor_parallel_comm_->all_gather_words(words_of(found, world_rank)), found, world_rank);
  const std::string seen_by = fmt::format("{} of {} ranks saw one", ranks, world_size_);
  if (found.slot < 0) return fmt::format("on a data-parallel rank of another replica ({})", seen_by);
  // Under context or pipeline parallelism the ranks are not data-parallel ranks alone.
  const bool data_parallel_only = !pipeline_comm_ && !tensor_parallel_comm_ && context_parallel_degree_ == 1;
  return fmt::format("{} ({}rank {}; {})", fp8_->describe(found), data_parallel_only ? "data-parallel " : "",
                     world_rank, seen_by);
}

void Trainer::end_fp8_step(bool update) {
  if (update && fp8_->delayed()) {
    if (dp_) dp_->all_reduce_max(fp8_->statistics());
    if (pipeline_comm_) pipeline_comm_->all_reduce_max(fp8_->statistics());  // NOTE [FP8 under context and pipeline parallelism]
    if (tensor_parallel_comm_) tensor_parallel_comm_->all_reduce_max(fp8_->statistics());  // NOTE [FP8 under tensor parallelism]
  }
  fp8_->end_step(update);
}

}  // namespace forge
