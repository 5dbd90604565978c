// The expert dispatch of a real expert-parallel group (NOTE [Expert parallelism] in
// model/expert_dispatch.h): the group's all-to-all, for counts and for rows. On CUDA both
// run on a stream of their own, as GroupContextParallel's ring steps do (NOTE [Streams and
// events] in core/device.h); on the CPU each is done when its call returns. The trainer
// makes one over the expert-parallel process group and hands it to the decoder; one rank
// alone has no need of it.
#pragma once

#include <memory>
#include <vector>

#include "core/device.h"
#include "distributed/process_group.h"
#include "model/expert_dispatch.h"

namespace forge {

class GroupExpertDispatch final : public ExpertDispatch {
 public:
  // `group` (the expert-parallel ranks; outlives this object) on `device`.
  GroupExpertDispatch(ProcessGroup& group, Device device);

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  // On CUDA on the exchange stream, which nothing else writes the counts' staging on: the
  // host waits for that stream alone, not for the compute stream's work.
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send, int64_t per_rank) override;
  // On CUDA on the exchange stream, after the compute stream's work so far (an event);
  // exchange_wait makes the compute stream wait for the last exchange started.
  void exchange_rows_start(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                           const std::vector<int64_t>& send_counts) override;
  void exchange_wait() override;

 private:
  ProcessGroup& group_;
  Device device_;
  Tensor send_, recv_;  // the counts' staging on the device, grown on demand
  // CUDA: the exchanges' stream, the compute stream's point a row exchange starts after,
  // and the last row exchange's end.
  std::unique_ptr<DeviceStream> stream_;
  std::unique_ptr<DeviceEvent> ready_, done_;
};

}  // namespace forge
