// The tensor parallelism of a real tensor-parallel group (NOTE [Tensor parallelism] in
// model/tensor_parallel.h): the group's all-gather, reduce-scatter and all-reduce, on the
// compute stream. The trainer makes one over the tensor-parallel process group and hands
// it to the decoder.
#pragma once

#include "distributed/process_group.h"
#include "model/tensor_parallel.h"

namespace forge {

class GroupTensorParallel final : public TensorParallel {
 public:
  // `group`: the tensor-parallel ranks; outlives this object.
  explicit GroupTensorParallel(ProcessGroup& group) : group_(group) {}

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  void gather_rows(const Tensor& full, const Tensor& local) override { group_.all_gather(full, local); }
  void reduce_scatter_rows(const Tensor& local, const Tensor& full) override {
    group_.reduce_scatter(local, full, ReduceOp::Sum);
  }
  void all_reduce_sum(const Tensor& tensor) override { group_.all_reduce(tensor, ReduceOp::Sum); }
  void all_reduce_max(const Tensor& tensor) override { group_.all_reduce(tensor, ReduceOp::Max); }

 private:
  ProcessGroup& group_;
};

}  // namespace forge
