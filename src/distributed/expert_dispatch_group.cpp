#include "distributed/expert_dispatch_group.h"

#include "core/error.h"

namespace forge {

GroupExpertDispatch::GroupExpertDispatch(ProcessGroup& group, Device device) : group_(group), device_(device) {}

std::vector<int64_t> GroupExpertDispatch::exchange_counts(const std::vector<int64_t>& send, int64_t per_rank) {
  const int64_t p = size();
  FORGE_CHECK(per_rank >= 1 && static_cast<int64_t>(send.size()) == p * per_rank,
              "expert dispatch: {} counts for {} ranks x {}", send.size(), p, per_rank);
  if (!send_.defined() || send_.numel() != p * per_rank) {
    send_ = Tensor::empty({p, per_rank}, DType::I64, device_);
    recv_ = Tensor::empty({p, per_rank}, DType::I64, device_);
  }
  copy_bytes(send_.raw(), device_, send.data(), Device::CPU, send.size() * sizeof(int64_t));
  const std::vector<int64_t> one_row_each(static_cast<size_t>(p), 1);
  group_.all_to_all(recv_, one_row_each, send_, one_row_each);
  std::vector<int64_t> recv(send.size());
  copy_bytes(recv.data(), Device::CPU, recv_.raw(), device_, recv.size() * sizeof(int64_t));  // waits for it
  for (int64_t c : recv)
    FORGE_CHECK(c >= 0, "expert dispatch: a rank announced {} rows (the ranks' routings disagree)", c);
  return recv;
}

void GroupExpertDispatch::exchange_rows(const Tensor& output, const std::vector<int64_t>& recv_counts,
                                        const Tensor& input, const std::vector<int64_t>& send_counts) {
  group_.all_to_all(output, recv_counts, input, send_counts);
}

}  // namespace forge
