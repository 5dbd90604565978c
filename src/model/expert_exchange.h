// A MoE layer's token rows on their way to the ranks that hold their experts, and back
// (NOTE [Expert parallelism] in model/expert_dispatch.h): the counts each rank sends and
// receives, the all-to-all through ExpertDispatch, and the sort of the received rows from
// (source rank, local expert) order into (local expert, source rank) order, so that each
// local expert's rows are contiguous for its GEMMs.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/expert_dispatch.h"
#include "ops/moe.h"

namespace forge {

class ExpertExchange {
 public:
  // The traffic of one layer's routing, planned once in its forward and reused by every
  // exchange of that layer until the next forward.
  struct Plan {
    std::vector<int64_t> send, recv;                // rows to / from each rank of the group
    std::vector<int64_t> send_chunks, recv_chunks;  // [P x local experts]: rows per (rank, local expert)
    int64_t received = 0;                           // sum of recv: the local rows
    // The local experts' rows in sorted order, as the expert ops read them: `experts` local
    // experts and their offsets; nothing else is set.
    MoeRouting local;
  };

  // `experts`: the model's routed experts, a multiple of the dispatch's size.
  ExpertExchange(ExpertDispatch& dispatch, int64_t experts);

  int64_t local_experts() const { return local_; }
  int64_t first_expert() const { return local_ * dispatch_.rank(); }
  int size() const { return dispatch_.size(); }

  // Exchanges the counts of `routing` (global expert ids, its host offsets) with the group;
  // a routing padded to capacity needs no exchange (every chunk is its capacity).
  Plan plan(const MoeRouting& routing);
  // origin [tokens * k, H] rows in `routing`'s permuted order → local [received, H] rows,
  // sorted by local expert; `staging` holds at least `received` rows of the same width.
  // In two halves (NOTE [Expert exchange overlap] in model/moe_feed_forward.cpp): between
  // dispatch_start and dispatch_finish the caller's work must neither write `origin` nor
  // touch `staging`; `local` is written by dispatch_finish, after the exchange.
  void dispatch_start(const Plan& plan, const Tensor& origin, const Tensor& staging);
  void dispatch_finish(const Plan& plan, const Tensor& local, const Tensor& staging);
  // The reverse: local [received, H] rows in sorted order → origin rows in permuted order.
  // Between combine_start and combine_finish the caller's work must touch neither `origin`
  // nor `staging`; `local` is free again when combine_start returns (sorted into staging).
  void combine_start(const Plan& plan, const Tensor& origin, const Tensor& local, const Tensor& staging);
  void combine_finish();

 private:
  // Copies each (rank, local expert) chunk between arrival order and sorted order.
  void sort_chunks(const Plan& plan, const Tensor& sorted, const Tensor& arrived, bool to_sorted);

  ExpertDispatch& dispatch_;
  int64_t experts_, local_;
};

}  // namespace forge
