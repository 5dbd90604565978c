// How a Mixture-of-Experts component reaches the experts it does not hold: the interface
// the model is handed for expert parallelism, as it is handed ParamSource and GradSink for
// its weights (NOTE [Composed blocks]). model/ never sees a process group; the trainer
// gives the decoder an implementation over one (distributed/expert_dispatch_group.h).
//
// NOTE [Expert parallelism]
// With parallelism.expert_parallel_degree P > 1 the ranks form expert-parallel groups of P
// consecutive ranks. Rank j of a group holds the routed experts [j E/P, (j + 1) E/P) of
// every MoE block (E/P local experts; everything else, the router and the shared experts
// included, is held as without expert parallelism). Each rank routes its own tokens over
// all E experts, then (model/expert_exchange.h):
//   1. permutes its tokens by expert (moe_permute): the rows for rank q's experts are one
//      contiguous run, since experts are numbered by rank;
//   2. tells every rank of its group how many rows it sends to each of its experts (an
//      all-to-all of E/P counts per rank: exchange_counts), so each rank knows what it
//      receives from each other rank for each local expert (padded to capacity, every
//      count is the capacity and nothing is exchanged: NOTE [MoE capacity] in ops/moe.h);
//   3. sends the rows (exchange_rows, an all-to-all with variable counts); a rank receives
//      them ordered (source rank, local expert) and sorts them to (local expert, source
//      rank), so each local expert's rows are contiguous;
//   4. runs its local experts' GEMMs on those rows (moe_experts_forward, E/P experts);
//   5. sorts the outputs back to (source rank, local expert) and returns them with the
//      reverse all-to-all, so every token's expert outputs arrive where its routing is, in
//      the order moe_permute made; moe_combine then adds them as on one rank.
// The backward runs the same exchange on the gradients: the expert outputs' gradients go
// to the experts' ranks (step 3), the experts' backward gives their inputs' gradients and
// the local experts' weight gradients (over every token of the group that chose them), and
// the inputs' gradients come back (step 5) for moe_permute_backward. The counts of the
// forward are kept per layer and reused, so the backward exchanges no counts. Routing,
// balancing losses and loads are each rank's, as without expert parallelism (the global
// balancing loss's counts are summed over every data-parallel rank either way).
// A rank may receive every row of its group (every token choosing its experts), so its
// received-row buffers hold P x tokens x k rows (StepShape::expert_parallel); a rank
// sending nothing, or an expert receiving nothing, is an ordinary case (zero counts).
// The weights: the local experts' slices of the stacked expert weights ([E/P, 2F, H] and
// [E/P, H, F]), which FSDP shards over the ranks holding the same experts (NOTE [FSDP
// layout]); their gradients are summed over those ranks, the other weights' over all ranks.
// On CUDA the exchanges run on a communication stream of their own, after the compute
// stream's work that produced their rows (events), and the compute stream waits for them only
// where it reads what they received: the shared experts' GEMMs run meanwhile (NOTE [Expert
// exchange overlap] in model/moe_feed_forward.cpp). On the CPU they are done when called.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace forge {

class ExpertDispatch {
 public:
  virtual ~ExpertDispatch() = default;

  // This rank's place in its expert-parallel group, and the group's size (P).
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // `send` holds size() x per_rank counts, per_rank for each rank in group order; returns
  // what each rank sent this one, the same shape (rank q's per_rank counts for this rank
  // at [q per_rank, (q + 1) per_rank)). Synchronizes the host with the exchange.
  virtual std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send, int64_t per_rank) = 0;

  // Rows of `input` to the group's ranks and theirs into `output`, as
  // ProcessGroup::all_to_all (NOTE [All-to-all]): send_counts[q] rows to rank q, in rank
  // order; recv_counts[q] rows from rank q, in rank order. It may return before the
  // exchange is done (on CUDA it runs on a communication stream, after the work already
  // enqueued on the compute stream), as ContextParallel::rotate_start does: the caller may
  // enqueue other work, which must neither write `input` nor touch `output`, and then calls
  // exchange_wait: work enqueued after it sees every exchange started so far done. Every
  // rank starts the same exchanges in the same order.
  virtual void exchange_rows_start(const Tensor& output, const std::vector<int64_t>& recv_counts,
                                   const Tensor& input, const std::vector<int64_t>& send_counts) = 0;
  virtual void exchange_wait() {}
  void exchange_rows(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                     const std::vector<int64_t>& send_counts) {
    exchange_rows_start(output, recv_counts, input, send_counts);
    exchange_wait();
  }
};

}  // namespace forge
