#include "distributed/ring_exchange.h"

namespace forge {

void RingExchange::start(const std::vector<Tensor>& received, const std::vector<Tensor>& sent) {
  const int c = group_.world_size(), next = (group_.rank() + 1) % c, previous = (group_.rank() + c - 1) % c;
  std::vector<PointToPoint> ops;
  for (const Tensor& t : sent) ops.push_back(PointToPoint::send(next, t));
  for (const Tensor& t : received) ops.push_back(PointToPoint::recv(previous, t));
  if (sent.empty() || sent.front().device() != Device::CUDA) {
    group_.send_recv(ops);
    return;
  }
  if (!stream_) {
    stream_ = std::make_unique<DeviceStream>(Device::CUDA);
    ready_ = std::make_unique<DeviceEvent>(Device::CUDA);
    done_ = std::make_unique<DeviceEvent>(Device::CUDA);
  }
  // NOTE [Streams and events]: the step reads and writes buffers the compute stream's work
  // so far produced or read.
  ready_->record(nullptr);
  ready_->make_wait(stream_->get());
  group_.send_recv(ops, stream_->get());
  done_->record(stream_->get());
}

void RingExchange::wait() {
  if (done_) done_->make_wait(nullptr);
}

}  // namespace forge
