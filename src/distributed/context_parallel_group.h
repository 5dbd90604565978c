// The context parallelism of a real context-parallel group (NOTE [Context parallelism] in
// model/context_parallel.h): the group's all-gather, reduce-scatter and all-reduce, on the
// compute stream. The trainer makes one over the context-parallel process group and hands
// it to the decoder.
#pragma once

#include "distributed/process_group.h"
#include "model/context_parallel.h"

namespace forge {

class GroupContextParallel final : public ContextParallel {
 public:
  // `group`: the context-parallel ranks; outlives this object.
  explicit GroupContextParallel(ProcessGroup& group) : group_(group) {}

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  void gather(const Tensor& full, const Tensor& local) override { group_.all_gather(full, local); }
  void reduce_scatter(const Tensor& local, const Tensor& full) override {
    group_.reduce_scatter(local, full, ReduceOp::Sum);
  }
  void all_reduce_sum(const Tensor& tensor) override { group_.all_reduce(tensor, ReduceOp::Sum); }

 private:
  ProcessGroup& group_;
};

}  // namespace forge
