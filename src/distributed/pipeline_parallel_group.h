// The pipeline parallelism of a real pipeline group (NOTE [Pipeline parallelism] in
// model/pipeline.h): each round of the schedule one batched send/receive of the group
// (ProcessGroup::send_recv, NOTE [Point-to-point]), on the compute stream. The trainer
// makes one over the pipeline-parallel process group and hands it to the PipelineModel.
#pragma once

#include <vector>

#include "distributed/process_group.h"
#include "model/pipeline.h"

namespace forge {

class GroupPipelineParallel final : public PipelineParallel {
 public:
  // `group`: the pipeline ranks, in stage order; outlives this object.
  explicit GroupPipelineParallel(ProcessGroup& group) : group_(group) {}

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  void exchange(const std::vector<Transfer>& transfers) override {
    std::vector<PointToPoint> ops;
    ops.reserve(transfers.size());
    for (const Transfer& t : transfers)
      ops.push_back({t.send ? PointToPoint::Kind::Send : PointToPoint::Kind::Recv, t.peer, t.tensor});
    group_.send_recv(ops);
  }

 private:
  ProcessGroup& group_;
};

}  // namespace forge
