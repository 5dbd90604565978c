// One step of a ring over a process group: every tensor of `sent` to the next rank and of
// `received` from the previous, paired in order, as one send_recv call (NOTE
// [Point-to-point] in process_group.h). Ring attention (NOTE [Ring attention] in
// model/context_parallel_ring.h) and async tensor parallelism (NOTE [Async tensor
// parallelism] in model/sequence_parallel.h) pass their blocks and row chunks this way.
// On CUDA a step runs on a stream of its own, after the compute stream's work so far (an
// event: the step reads and writes buffers that work produced or read); wait() makes the
// compute stream wait for the last step started. On the CPU a step is done when start
// returns.
#pragma once

#include <memory>
#include <vector>

#include "core/device.h"
#include "distributed/process_group.h"

namespace forge {

class RingExchange {
 public:
  // `group`: the ring's ranks, in rank order; outlives this object.
  explicit RingExchange(ProcessGroup& group) : group_(group) {}

  void start(const std::vector<Tensor>& received, const std::vector<Tensor>& sent);
  void wait();

 private:
  ProcessGroup& group_;
  // CUDA: the ring's stream, the compute stream's point it starts after, and its last step.
  std::unique_ptr<DeviceStream> stream_;
  std::unique_ptr<DeviceEvent> ready_, done_;
};

}  // namespace forge
