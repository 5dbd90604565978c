#include "model/expert_exchange.h"

#include "core/device.h"
#include "core/error.h"

namespace forge {

ExpertExchange::ExpertExchange(ExpertDispatch& dispatch, int64_t experts)
    : dispatch_(dispatch), experts_(experts), local_(experts / dispatch.size()) {
  FORGE_CHECK(dispatch.size() >= 1 && experts % dispatch.size() == 0,
              "expert parallelism: {} experts cannot be split over {} ranks", experts, dispatch.size());
}

ExpertExchange::Plan ExpertExchange::plan(const MoeRouting& routing) {
  FORGE_CHECK(routing.experts == experts_ && routing.offsets.size() == static_cast<size_t>(experts_ + 1),
              "expert parallelism: a routing over {} experts for a layer of {}", routing.experts, experts_);
  const int p = size();
  Plan plan;
  plan.send_chunks.resize(static_cast<size_t>(experts_));
  for (int64_t e = 0; e < experts_; ++e) plan.send_chunks[static_cast<size_t>(e)] = routing.rows(e);
  // Padded to capacity (NOTE [MoE capacity]) every rank sends each expert exactly its
  // capacity, the same on every rank of the group (the same micro-batch shape and config):
  // what arrives is known without asking, and the layer makes no host synchronization.
  plan.recv_chunks = routing.pad ? std::vector<int64_t>(static_cast<size_t>(experts_), routing.capacity)
                                 : dispatch_.exchange_counts(plan.send_chunks, local_);
  FORGE_CHECK(plan.recv_chunks.size() == static_cast<size_t>(experts_),
              "expert parallelism: {} counts received for {} ranks x {} local experts", plan.recv_chunks.size(), p,
              local_);
  plan.send.assign(static_cast<size_t>(p), 0);
  plan.recv.assign(static_cast<size_t>(p), 0);
  for (int q = 0; q < p; ++q)
    for (int64_t l = 0; l < local_; ++l) {
      const size_t c = static_cast<size_t>(q * local_ + l);
      plan.send[static_cast<size_t>(q)] += plan.send_chunks[c];
      plan.recv[static_cast<size_t>(q)] += plan.recv_chunks[c];
    }
  plan.local.experts = local_;
  plan.local.offsets.assign(static_cast<size_t>(local_ + 1), 0);
  for (int64_t l = 0; l < local_; ++l) {
    int64_t rows = 0;
    for (int q = 0; q < p; ++q) rows += plan.recv_chunks[static_cast<size_t>(q * local_ + l)];
    plan.local.offsets[static_cast<size_t>(l + 1)] = plan.local.offsets[static_cast<size_t>(l)] + rows;
  }
  plan.received = plan.local.offsets.back();
  plan.local.tokens = plan.received;
  plan.local.k = 1;
  return plan;
}

void ExpertExchange::sort_chunks(const Plan& plan, const Tensor& sorted, const Tensor& arrived, bool to_sorted) {
  const int p = size();
  const int64_t width = arrived.numel() / arrived.dim(0);
  const size_t row_bytes = static_cast<size_t>(width) * dtype_size(arrived.dtype());
  std::vector<int64_t> next(plan.local.offsets.begin(), plan.local.offsets.end() - 1);  // per local expert
  int64_t at = 0;  // the arrival order's next row: (rank, local expert) order
  for (int q = 0; q < p; ++q)
    for (int64_t l = 0; l < local_; ++l) {
      const int64_t n = plan.recv_chunks[static_cast<size_t>(q * local_ + l)];
      int64_t& to = next[static_cast<size_t>(l)];
      if (n > 0) {
        char* s = static_cast<char*>(sorted.raw()) + static_cast<size_t>(to) * row_bytes;
        char* a = static_cast<char*>(arrived.raw()) + static_cast<size_t>(at) * row_bytes;
        if (to_sorted) copy_bytes_on(s, sorted.device(), a, arrived.device(), static_cast<size_t>(n) * row_bytes, nullptr);
        else copy_bytes_on(a, arrived.device(), s, sorted.device(), static_cast<size_t>(n) * row_bytes, nullptr);
      }
      to += n;
      at += n;
    }
}

void ExpertExchange::dispatch_start(const Plan& plan, const Tensor& origin, const Tensor& staging) {
  FORGE_CHECK(staging.dim(0) >= plan.received, "expert parallelism: {} rows received into a staging buffer of {}",
              plan.received, staging.dim(0));
  dispatch_.exchange_rows_start(staging, plan.recv, origin, plan.send);
}

void ExpertExchange::dispatch_finish(const Plan& plan, const Tensor& local, const Tensor& staging) {
  FORGE_CHECK(local.dim(0) >= plan.received, "expert parallelism: {} rows received into a buffer of {}",
              plan.received, local.dim(0));
  dispatch_.exchange_wait();
  sort_chunks(plan, local, staging, true);
}

void ExpertExchange::combine_start(const Plan& plan, const Tensor& origin, const Tensor& local, const Tensor& staging) {
  sort_chunks(plan, local, staging, false);
  dispatch_.exchange_rows_start(origin, plan.send, staging, plan.recv);
}

void ExpertExchange::combine_finish() { dispatch_.exchange_wait(); }

}  // namespace forge
