#include "distributed/expert_dispatch_group.h"

#include "core/error.h"

// NOTE [Expert parallelism under hybrid sharding]
// With parallelism.data_parallel_replicate_degree R > 1 the data-parallel ranks are R
// replicas of S consecutive shard ranks (NOTE [Device mesh] in train/trainer.cpp), and
// expert parallelism of degree P (dividing S) lives inside each replica, as torchtitan's
// HSDP + EP and Megatron's expert data parallelism put it (the expert all-to-alls inside a
// node, only gradient reductions across nodes):
//   - the expert-parallel groups are P consecutive shard ranks of one replica (rank r's is
//     [r - r % P, r - r % P + P), which never crosses a replica since P divides S);
//   - the expert parts of the MoE blocks' units (NOTE [FSDP layout]) are sharded over the
//     S / P shard ranks of the replica that hold the same experts (the expert group of
//     shard rank s: the replica's shard ranks with its s % P, chunk s / P), as without
//     replicas: the layout is a shard group's, the same in every replica;
//   - so shard rank s of every replica holds the same chunk of every part, dense and
//     expert: a unit's gradients are reduce-scattered over the shard group (the dense part)
//     and the expert group (the expert part), and the rank's whole chunk is then
//     all-reduced over the replicate group, as hybrid sharding does for dense models;
//   - the rest is data parallelism's: the gradient norm sums the shard group's chunks (the
//     replicas hold the same), the step's counts, losses and routing-bias loads (NOTE
//     [Routing bias update]) are summed over the shard and then the replicate group (every
//     data-parallel rank), and the first replica's shard ranks write checkpoints, whose
//     segments tile the flat index space once whatever the layout, so a checkpoint resumes
//     under any other replicate, shard or expert-parallel degree; the Hugging Face export
//     gathers the first replica's shards to world rank 0 (Fsdp::gather_to_host).
// Under pipeline parallelism the same holds per stage (NOTE [Expert parallelism under
// pipeline parallelism] in model/pipeline.h): a stage's R x S ranks are its replicas and
// shard ranks, and FSDP over a pipeline rank's stages reduces its replicas after the
// schedule as it does without experts.

namespace forge {

GroupExpertDispatch::GroupExpertDispatch(ProcessGroup& group, Device device) : group_(group), device_(device) {
  if (device_ == Device::CUDA) {
    stream_ = std::make_unique<DeviceStream>(device_);
    ready_ = std::make_unique<DeviceEvent>(device_);
    done_ = std::make_unique<DeviceEvent>(device_);
  }
}

std::vector<int64_t> GroupExpertDispatch::exchange_counts(const std::vector<int64_t>& send, int64_t per_rank) {
  const int64_t p = size();
  FORGE_CHECK(per_rank >= 1 && static_cast<int64_t>(send.size()) == p * per_rank,
              "expert dispatch: {} counts for {} ranks x {}", send.size(), p, per_rank);
  if (!send_.defined() || send_.numel() != p * per_rank) {
    send_ = Tensor::empty({p, per_rank}, DType::I64, device_);
    recv_ = Tensor::empty({p, per_rank}, DType::I64, device_);
  }
  // The counts come from the host and go back to it: nothing on the compute stream is
  // waited for (it goes on, with the permutation, while they travel), and the staging is
  // written and read on the exchange stream alone, in its order. The host waits for them.
  const CudaStream stream = stream_ ? stream_->get() : nullptr;
  copy_bytes_on(send_.raw(), device_, send.data(), Device::CPU, send.size() * sizeof(int64_t), stream);
  const std::vector<int64_t> one_row_each(static_cast<size_t>(p), 1);
  group_.all_to_all(recv_, one_row_each, send_, one_row_each, stream);
  std::vector<int64_t> recv(send.size());
  copy_bytes_on(recv.data(), Device::CPU, recv_.raw(), device_, recv.size() * sizeof(int64_t), stream);
  if (stream_) stream_->synchronize();
  for (int64_t c : recv)
    FORGE_CHECK(c >= 0, "expert dispatch: a rank announced {} rows (the ranks' routings disagree)", c);
  return recv;
}

void GroupExpertDispatch::exchange_rows_start(const Tensor& output, const std::vector<int64_t>& recv_counts,
                                              const Tensor& input, const std::vector<int64_t>& send_counts) {
  if (!stream_) {
    group_.all_to_all(output, recv_counts, input, send_counts);
    return;
  }
  // NOTE [Streams and events]: the exchange reads rows the compute stream's work so far
  // wrote, and writes rows it may have read.
  ready_->record(nullptr);
  ready_->make_wait(stream_->get());
  group_.all_to_all(output, recv_counts, input, send_counts, stream_->get());
  done_->record(stream_->get());
}

void GroupExpertDispatch::exchange_wait() {
  if (done_) done_->make_wait(nullptr);
}

}  // namespace forge
