#include "distributed/data_parallel_comm.h"

#include "core/error.h"

namespace forge {
namespace {

constexpr CudaStream kCompute = nullptr;  // the stream forge's kernels run on

}  // namespace

DataParallelComm::DataParallelComm(Device device, ProcessGroup& shard_group, ProcessGroup* replicate_group)
    : device_(device),
      shard_group_(shard_group),
      replicate_group_(replicate_group),
      comm_(device),
      comm_done_(std::make_unique<DeviceEvent>(device)),
      norm_scratch_(Tensor::zeros({3}, DType::F32, device)),
      count_scratch_(Tensor::zeros({kCountDigits}, DType::F32, device)) {}

DataParallelComm::~DataParallelComm() {
  // Nothing may still run on the communication stream when its buffers go.
  try {
    comm_.synchronize();
  } catch (...) {
  }
}

void DataParallelComm::reset_exposed_comm() {
  stalls_used_ = 0;
  host_exposed_s_ = 0;
}

void DataParallelComm::join_comm() {
  begin_exposed();
  comm_done_->record(comm_.get());
  comm_done_->make_wait(kCompute);
  end_exposed();
}

double DataParallelComm::all_reduce_scalar(ProcessGroup& group, double value) {
  return all_reduce_values(group, {value}).front();
}

std::vector<double> DataParallelComm::all_reduce_values(ProcessGroup& group, const std::vector<double>& values) {
  const auto count = static_cast<int64_t>(values.size());
  if (norm_scratch_.numel() < count) norm_scratch_ = Tensor::zeros({count}, DType::F32, device_);
  const Tensor scratch = norm_scratch_.narrow(0, count);
  Tensor host = Tensor::empty({count}, DType::F32);
  for (int64_t i = 0; i < count; ++i) host.data<float>()[i] = static_cast<float>(values[static_cast<size_t>(i)]);
  scratch.copy_from(host);
  join_comm();  // one collective at a time on the communicator, in the same order everywhere
  begin_exposed();
  group.all_reduce(scratch, ReduceOp::Sum, kCompute);
  end_exposed();
  const Tensor out = scratch.to(Device::CPU);
  return {out.data<float>(), out.data<float>() + count};
}

std::pair<double, double> DataParallelComm::sum_over_ranks(double first, double second) {
  const std::vector<double> sums = sum_over_ranks(std::vector<double>{first, second});
  return {sums[0], sums[1]};
}

std::vector<double> DataParallelComm::sum_over_ranks(const std::vector<double>& values) {
  const std::vector<double> sums = all_reduce_values(shard_group_, values);
  return replicate_group_ ? all_reduce_values(*replicate_group_, sums) : sums;
}

// fp32 adds whole numbers exactly while every partial sum stays below 2^24, so the count
// travels as three 12-bit digits: each digit's sum over at most 4096 ranks is exact in
// any order of addition (NCCL's included), and the count is exact up to 2^36.
int64_t DataParallelComm::data_parallel_ranks() const {
  return int64_t{shard_group_.world_size()} * (replicate_group_ ? replicate_group_->world_size() : 1);
}

int64_t DataParallelComm::count_over_ranks(int64_t count) { return counts_over_ranks({count}).front(); }

// Exact in fp32: each count is split into kCountDigits digits of 12 bits, which stay below
// 2^24 when summed over at most 4096 ranks, and recombined on the host.
std::vector<int64_t> DataParallelComm::counts_over_ranks(const std::vector<int64_t>& counts) {
  constexpr int kDigitBits = 12;
  const int64_t ranks = data_parallel_ranks();
  const int64_t n = static_cast<int64_t>(counts.size());
  Tensor host = Tensor::empty({n * kCountDigits}, DType::F32);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t count = counts[static_cast<size_t>(i)];
    FORGE_CHECK(count >= 0 && count < (int64_t{1} << (kDigitBits * kCountDigits)) && ranks <= (1 << kDigitBits),
                "count_over_ranks: {} on {} ranks is outside what the exact fp32 digit sum holds", count, ranks);
    for (int d = 0; d < kCountDigits; ++d)
      host.data<float>()[i * kCountDigits + d] =
          static_cast<float>((count >> (kDigitBits * d)) & ((1 << kDigitBits) - 1));
  }
  if (count_scratch_.numel() < host.numel()) count_scratch_ = Tensor::zeros({host.numel()}, DType::F32, device_);
  const Tensor scratch = count_scratch_.narrow(0, host.numel());
  scratch.copy_from(host);
  join_comm();  // one collective at a time on the communicator, in the same order everywhere
  begin_exposed();
  shard_group_.all_reduce(scratch, ReduceOp::Sum, kCompute);
  if (replicate_group_) replicate_group_->all_reduce(scratch, ReduceOp::Sum, kCompute);
  end_exposed();
  host = scratch.to(Device::CPU);
  std::vector<int64_t> totals(counts.size(), 0);
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < kCountDigits; ++d)
      totals[static_cast<size_t>(i)] += static_cast<int64_t>(host.data<float>()[i * kCountDigits + d])
                                        << (kDigitBits * d);
  return totals;
}

void DataParallelComm::all_reduce_sum(const Tensor& tensor) { all_reduce(tensor, ReduceOp::Sum); }

void DataParallelComm::all_reduce_max(const Tensor& tensor) { all_reduce(tensor, ReduceOp::Max); }

void DataParallelComm::all_reduce(const Tensor& tensor, ReduceOp op) {
  join_comm();  // one collective at a time on the communicator, in the same order everywhere
  begin_exposed();
  shard_group_.all_reduce(tensor, op, kCompute);
  if (replicate_group_) replicate_group_->all_reduce(tensor, op, kCompute);
  end_exposed();
}

double DataParallelComm::sum_over_ranks(double value) {
  value = all_reduce_scalar(shard_group_, value);
  return replicate_group_ ? all_reduce_scalar(*replicate_group_, value) : value;
}

std::vector<uint32_t> DataParallelComm::all_gather_words(const std::vector<uint32_t>& words) {
  // fp32 tensors carry the bits: an all-gather only moves them.
  const int64_t n = std::max<int64_t>(static_cast<int64_t>(words.size()), 1);
  Tensor mine = Tensor::zeros({n}, DType::F32);
  std::copy_n(words.data(), words.size(), static_cast<uint32_t*>(mine.raw()));
  Tensor all = Tensor::empty({n * shard_group_.world_size()}, DType::F32, device_);
  join_comm();
  shard_group_.all_gather(all, mine.to(device_), kCompute);
  const Tensor host = all.to(Device::CPU);
  std::vector<uint32_t> result(static_cast<size_t>(n * shard_group_.world_size()));
  std::copy_n(static_cast<const uint32_t*>(host.raw()), result.size(), result.data());
  if (words.empty()) result.clear();
  return result;
}

void DataParallelComm::begin_exposed() {
  if (device_ != Device::CUDA) {
    host_stall_start_ = std::chrono::steady_clock::now();
    return;
  }
  if (stalls_used_ == stall_events_.size())
    stall_events_.emplace_back(std::make_unique<DeviceEvent>(device_, true), std::make_unique<DeviceEvent>(device_, true));
  stall_events_[stalls_used_].first->record(kCompute);
}

void DataParallelComm::end_exposed() {
  if (device_ != Device::CUDA) {
    host_exposed_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - host_stall_start_).count();
    return;
  }
  stall_events_[stalls_used_++].second->record(kCompute);
}

double DataParallelComm::take_exposed_comm_seconds() {
  double total = host_exposed_s_;
  for (size_t i = 0; i < stalls_used_; ++i)
    total += DeviceEvent::elapsed_seconds(*stall_events_[i].first, *stall_events_[i].second);
  stalls_used_ = 0;
  host_exposed_s_ = 0;
  return total;
}
}  // namespace forge
