#include "distributed/context_parallel_group.h"

namespace forge {

void GroupContextParallel::rotate_start(const std::vector<Tensor>& received, const std::vector<Tensor>& sent) {
  const int c = size(), next = (rank() + 1) % c, previous = (rank() + c - 1) % c;
  std::vector<PointToPoint> ops;
  for (const Tensor& t : sent) ops.push_back(PointToPoint::send(next, t));
  for (const Tensor& t : received) ops.push_back(PointToPoint::recv(previous, t));
  if (sent.empty() || sent.front().device() != Device::CUDA) {
    group_.send_recv(ops);
    return;
  }
  if (!ring_stream_) {
    ring_stream_ = std::make_unique<DeviceStream>(Device::CUDA);
    ring_ready_ = std::make_unique<DeviceEvent>(Device::CUDA);
    ring_done_ = std::make_unique<DeviceEvent>(Device::CUDA);
  }
  // NOTE [Streams and events]: the step reads and writes buffers the compute stream's work
  // so far produced or read.
  ring_ready_->record(nullptr);
  ring_ready_->make_wait(ring_stream_->get());
  group_.send_recv(ops, ring_stream_->get());
  ring_done_->record(ring_stream_->get());
}

void GroupContextParallel::rotate_wait() {
  if (ring_done_) ring_done_->make_wait(nullptr);
}

}  // namespace forge
