// How a model sums counts over the data-parallel ranks: the interface model/ is handed for
// Megatron's global balancing loss (NOTE [MoE balancing loss] in model/moe_feed_forward.h),
// whose tokens per expert are every rank's, as it is handed ExpertDispatch for expert
// parallelism. model/ never sees a process group: distributed/DataParallelComm implements it
// over the trainer's data-parallel ranks.
#pragma once

#include <cstdint>
#include <vector>

namespace forge {

class DataParallelCounts {
 public:
  virtual ~DataParallelCounts() = default;

  // The data-parallel ranks whose counts are summed (each routes micro-batches of the same shape).
  virtual int64_t data_parallel_ranks() const = 0;
  // Each of `counts` (0 <= count < 2^36) summed exactly over the data-parallel ranks, in one
  // reduction; every rank calls it with as many counts, in the same order. Synchronizes the
  // host with the reduction.
  virtual std::vector<int64_t> counts_over_ranks(const std::vector<int64_t>& counts) = 0;
};

}  // namespace forge
