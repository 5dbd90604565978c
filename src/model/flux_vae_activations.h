// Activation buffers of the FLUX VAE's forward passes, reused across layers and calls.
//
// NOTE [VAE activation pool]
// The VAE's activations are large (one image at 1024x1024 is 128 channels x a million pixels
// at the encoder's first level, 256 MB in bf16) and short-lived: each layer reads one or two
// of them and writes one. The pool keeps a few device buffers; take(shape) lends a free one
// as a tensor of that shape (growing it first if it is too small: nothing else holds it), and
// the lease gives it back when it goes out of scope. A forward pass thus holds a handful of
// buffers (a ResNet block's input, its intermediates, the shortcut; the attention's q, k, v
// and probabilities), and a second call with the same image size allocates nothing (on
// CUDA, cudaMalloc and cudaFree would synchronize the device at every layer).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace forge {

class VaeActivationPool {
 public:
  VaeActivationPool(Device device, DType dtype) : device_(device), dtype_(dtype) {}

  // A buffer lent as a tensor; it returns to the pool when the lease is destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept {
      if (this != &other) {
        release();
        pool_ = other.pool_;
        slot_ = other.slot_;
        tensor_ = other.tensor_;
        other.pool_ = nullptr;
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { release(); }

    const Tensor& operator*() const { return tensor_; }
    const Tensor* operator->() const { return &tensor_; }

   private:
    friend class VaeActivationPool;
    Lease(VaeActivationPool* pool, size_t slot, Tensor tensor) : pool_(pool), slot_(slot), tensor_(std::move(tensor)) {}
    void release() {
      if (pool_) pool_->busy_[slot_] = false;
      pool_ = nullptr;
    }

    VaeActivationPool* pool_ = nullptr;
    size_t slot_ = 0;
    Tensor tensor_;
  };

  Lease take(const Shape& shape) {
    const int64_t n = shape_numel(shape);
    size_t best = buffers_.size();
    for (size_t i = 0; i < buffers_.size(); ++i) {  // the smallest free buffer that fits, else the largest free one
      if (busy_[i]) continue;
      if (best == buffers_.size()) {
        best = i;
        continue;
      }
      const int64_t have = buffers_[i].numel(), chosen = buffers_[best].numel();
      const bool fits = have >= n, chosen_fits = chosen >= n;
      if ((fits && (!chosen_fits || have < chosen)) || (!fits && !chosen_fits && have > chosen)) best = i;
    }
    if (best == buffers_.size()) {
      buffers_.emplace_back();
      busy_.push_back(false);
    }
    if (buffers_[best].numel() < n || !buffers_[best].defined()) buffers_[best] = Tensor::empty({n}, dtype_, device_);
    busy_[best] = true;
    return Lease(this, best, Tensor::wrap(buffers_[best].raw(), shape, dtype_, device_));
  }

  // Elements held in all buffers (for tests of the reuse).
  int64_t held_elements() const {
    int64_t total = 0;
    for (const Tensor& b : buffers_) total += b.defined() ? b.numel() : 0;
    return total;
  }

 private:
  Device device_;
  DType dtype_;
  std::vector<Tensor> buffers_;
  std::vector<bool> busy_;
};

}  // namespace forge
