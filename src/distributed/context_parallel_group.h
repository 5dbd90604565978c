// The context parallelism of a real context-parallel group (NOTE [Context parallelism] in
// model/context_parallel.h): the group's all-gather, reduce-scatter, all-reduce and ring
// steps (send_recv), on the compute stream. The trainer makes one over the context-parallel
// process group and hands it to the decoder.
#pragma once

#include <vector>

#include "distributed/process_group.h"
#include "distributed/ring_exchange.h"
#include "model/context_parallel.h"

namespace forge {

class GroupContextParallel final : public ContextParallel {
 public:
  // `group`: the context-parallel ranks; outlives this object.
  explicit GroupContextParallel(ProcessGroup& group) : group_(group), ring_(group) {}

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  void gather(const Tensor& full, const Tensor& local) override { group_.all_gather(full, local); }
  void reduce_scatter(const Tensor& local, const Tensor& full) override {
    group_.reduce_scatter(local, full, ReduceOp::Sum);
  }
  void all_reduce_sum(const Tensor& tensor) override { group_.all_reduce(tensor, ReduceOp::Sum); }
  // One step of the ring (distributed/ring_exchange.h, NOTE [Point-to-point]): every tensor
  // of `sent` to the next rank and of `received` from the previous, paired in order. On CUDA
  // on a stream of its own, after the compute stream's work so far (an event); rotate_wait
  // makes the compute stream wait for the last step started. On the CPU the call is done
  // when it returns.
  void rotate_start(const std::vector<Tensor>& received, const std::vector<Tensor>& sent) override;
  void rotate_wait() override;

 private:
  ProcessGroup& group_;
  RingExchange ring_;
};

}  // namespace forge
