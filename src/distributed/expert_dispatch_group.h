// The expert dispatch of a real expert-parallel group (NOTE [Expert parallelism] in
// model/expert_dispatch.h): the group's all-to-all, on the compute stream, for counts and
// for rows. The trainer makes one over the expert-parallel process group and hands it to
// the decoder; one rank alone has no need of it.
#pragma once

#include <vector>

#include "distributed/process_group.h"
#include "model/expert_dispatch.h"

namespace forge {

class GroupExpertDispatch final : public ExpertDispatch {
 public:
  // `group` (the expert-parallel ranks; outlives this object) on `device`.
  GroupExpertDispatch(ProcessGroup& group, Device device);

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send, int64_t per_rank) override;
  void exchange_rows(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                     const std::vector<int64_t>& send_counts) override;

 private:
  ProcessGroup& group_;
  Device device_;
  Tensor send_, recv_;  // the counts' staging on the device, grown on demand
};

}  // namespace forge
