// The collectives a data-parallel training step runs besides moving parameters: the loss,
// the target count and stop flags summed over every rank, a tensor all-reduced in place,
// words all-gathered for checkpoints, with the stall they cost timed (NOTE [Exposed
// communication] in distributed/fsdp.h). Fsdp is one (its gathers and reductions use the
// same communication stream and timing); a QLoRA run, whose NF4 base is replicated rather
// than sharded (NOTE [LoRA under data parallelism] in train/trainer.cpp), uses one alone.
// It is also the model's DataParallelCounts (Megatron's global balancing loss: NOTE [MoE
// balancing loss] in model/moe_feed_forward.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "distributed/process_group.h"
#include "model/data_parallel_counts.h"

namespace forge {

class DataParallelComm : public DataParallelCounts {
 public:
  // shard_group: the ranks that split the parameters (all of them when nothing is split);
  // replicate_group (may be null): the ranks that hold the same chunk. Both outlive this object.
  DataParallelComm(Device device, ProcessGroup& shard_group, ProcessGroup* replicate_group);
  ~DataParallelComm() override;
  DataParallelComm(const DataParallelComm&) = delete;
  DataParallelComm& operator=(const DataParallelComm&) = delete;

  // `value` summed over every data-parallel rank (shard and replicate groups).
  double sum_over_ranks(double value);
  // Two values summed in one reduction (the step's loss and its stop flag, NOTE [Stop signals]).
  std::pair<double, double> sum_over_ranks(double first, double second);
  // Several values summed in one reduction (the step's loss, stop flag and FP8 flag), in
  // fp32 as the others.
  std::vector<double> sum_over_ranks(const std::vector<double>& values);
  // `count` (0 <= count < 2^36) summed exactly over every data-parallel rank (at most 4096).
  int64_t count_over_ranks(int64_t count);
  // Each of `counts` (as count_over_ranks) summed over every data-parallel rank, in one
  // reduction: a Mixture-of-Experts step's expert loads, and the global balancing loss's
  // tokens per expert of each micro-batch.
  std::vector<int64_t> counts_over_ranks(const std::vector<int64_t>& counts) override;
  // Every data-parallel rank: the shard group's times the replicate group's.
  int64_t data_parallel_ranks() const override;
  // `tensor` (on this device) summed in place over every data-parallel rank: LoRA's
  // replicated adapter gradients. Every rank ends with the same bits.
  void all_reduce_sum(const Tensor& tensor);
  // The elementwise maximum over every data-parallel rank, in place (fp32): FP8 amaxes
  // (NOTE [FP8 under data parallelism] in train/trainer_fp8.cpp).
  void all_reduce_max(const Tensor& tensor);
  // Every shard rank's `words` (equal counts), in rank order.
  std::vector<uint32_t> all_gather_words(const std::vector<uint32_t>& words);
  // NOTE [Exposed communication]: seconds the compute stream waited for communication
  // since the last call (synchronizes with the last such wait).
  double take_exposed_comm_seconds();
  // Forgets the stalls timed so far (what evaluation waited for is not the step's).
  void reset_exposed_comm();

 protected:
  // Makes the compute stream wait for everything enqueued on the communication stream
  // (before a collective of its own, and at the end of the step's reductions).
  void join_comm();
  // Stall timing (NOTE [Exposed communication]): event pairs on CUDA, a host clock on the CPU.
  void begin_exposed();
  void end_exposed();
  double all_reduce_scalar(ProcessGroup& group, double value);

  Device device_;
  ProcessGroup& shard_group_;
  ProcessGroup* replicate_group_;
  DeviceStream comm_;

 private:
  std::vector<double> all_reduce_values(ProcessGroup& group, const std::vector<double>& values);
  void all_reduce(const Tensor& tensor, ReduceOp op);

  std::unique_ptr<DeviceEvent> comm_done_;
  Tensor norm_scratch_;
  static constexpr int kCountDigits = 3;  // count_over_ranks
  Tensor count_scratch_;  // [kCountDigits x the most counts reduced at once]
  std::vector<std::pair<std::unique_ptr<DeviceEvent>, std::unique_ptr<DeviceEvent>>> stall_events_;
  size_t stalls_used_ = 0;
  double host_exposed_s_ = 0;
  std::chrono::steady_clock::time_point host_stall_start_;
};

}  // namespace forge
