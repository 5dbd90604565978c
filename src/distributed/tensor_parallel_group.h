// The tensor parallelism of a real tensor-parallel group (NOTE [Tensor parallelism] in
// model/tensor_parallel.h): the group's all-gather, reduce-scatter and all-reduce, on the
// compute stream, and the ring steps of async tensor parallelism (NOTE [Async tensor
// parallelism] in model/sequence_parallel.h; distributed/ring_exchange.h: on CUDA on a
// stream of their own, ordered by events). The trainer makes one over the tensor-parallel
// process group and hands it to the decoder.
#pragma once

#include "distributed/process_group.h"
#include "distributed/ring_exchange.h"
#include "model/tensor_parallel.h"

namespace forge {

class GroupTensorParallel final : public TensorParallel {
 public:
  // `group`: the tensor-parallel ranks; outlives this object.
  explicit GroupTensorParallel(ProcessGroup& group) : group_(group), ring_(group) {}

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  void gather_rows(const Tensor& full, const Tensor& local) override { group_.all_gather(full, local); }
  void reduce_scatter_rows(const Tensor& local, const Tensor& full) override {
    group_.reduce_scatter(local, full, ReduceOp::Sum);
  }
  void all_reduce_sum(const Tensor& tensor) override { group_.all_reduce(tensor, ReduceOp::Sum); }
  void all_reduce_max(const Tensor& tensor) override { group_.all_reduce(tensor, ReduceOp::Max); }
  void ring_start(const std::vector<Tensor>& received, const std::vector<Tensor>& sent) override {
    ring_.start(received, sent);
  }
  void ring_wait() override { ring_.wait(); }

 private:
  ProcessGroup& group_;
  RingExchange ring_;
};

}  // namespace forge
