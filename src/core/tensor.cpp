#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include "core/checked_math.h"
#include "core/device.h"

namespace forge {

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// Shapes read from files (safetensors headers, checkpoint metadata) are bounded where they
// are read; an overflow here is a reader that forgot to, so it throws instead of wrapping.
int64_t shape_numel(const Shape& shape) {
  const std::optional<int64_t> n = checked_numel(shape);
  FORGE_CHECK(n.has_value(), "the element count of shape {} overflows 64-bit integers", shape_str(shape));
  return *n;
}

std::optional<int64_t> checked_numel(const Shape& shape) {
  std::optional<int64_t> n = 1;
  for (int64_t d : shape) n = n ? checked_mul(*n, d) : std::nullopt;
  return n;
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  for (int64_t d : shape) FORGE_CHECK(d >= 0, "negative dimension in {}", shape_str(shape));
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  if (device == Device::CUDA) {
    void* p = device_malloc(t.nbytes());
    t.storage_ = std::shared_ptr<void>(p, device_free);
    t.data_ = p;
    return t;
  }
  size_t bytes = std::max<size_t>(t.nbytes(), 1);
  size_t aligned = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, aligned);
  FORGE_CHECK(p != nullptr, "out of host memory allocating {} bytes", aligned);
  t.storage_ = std::shared_ptr<void>(p, std::free);
  t.data_ = p;
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  t.fill_zero();
  return t;
}

Tensor Tensor::wrap(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.data_ = data;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::view(Shape shape) const {
  FORGE_CHECK(shape_numel(shape) == numel(), "cannot view {} as {}", shape_str(shape_), shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::narrow(int64_t begin, int64_t end) const {
  FORGE_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
              "narrow [{}, {}) out of range for {}", begin, end, shape_str(shape_));
  Tensor t = *this;
  int64_t row = numel() / std::max<int64_t>(shape_[0], 1);
  t.data_ = static_cast<char*>(data_) + begin * row * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  return t;
}

void Tensor::fill_zero() const {
  if (!nbytes()) return;
  if (device_ == Device::CUDA) {
    device_memset_zero(data_, nbytes());
    return;
  }
  std::memset(data_, 0, nbytes());
}

Tensor Tensor::clone() const { return to(device_); }

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) const {
  FORGE_CHECK(src.numel() == numel() && src.dtype() == dtype_, "copy {} {} into {} {}",
              dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dtype_), shape_str(shape_));
  copy_bytes(data_, device_, src.raw(), src.device(), nbytes());
}

void copy_columns(const Tensor& dst, int64_t dst_begin, const Tensor& src, int64_t src_begin, int64_t width) {
  FORGE_CHECK(dst.ndim() == 2 && src.ndim() == 2 && dst.dim(0) == src.dim(0) && dst.dtype() == src.dtype() &&
                  dst.device() == src.device(),
              "copy_columns: {} {} on {} into {} {} on {} (2-D, the same rows, dtype and device)",
              dtype_name(src.dtype()), shape_str(src.shape()), device_name(src.device()), dtype_name(dst.dtype()),
              shape_str(dst.shape()), device_name(dst.device()));
  FORGE_CHECK(width >= 0 && src_begin >= 0 && dst_begin >= 0 && src_begin + width <= src.dim(1) &&
                  dst_begin + width <= dst.dim(1),
              "copy_columns: columns [{}, {}) of {} into [{}, {}) of {}", src_begin, src_begin + width,
              shape_str(src.shape()), dst_begin, dst_begin + width, shape_str(dst.shape()));
  const size_t element = dtype_size(dst.dtype());
  copy_bytes_2d(static_cast<char*>(dst.raw()) + dst_begin * element, dst.dim(1) * element,
                static_cast<const char*>(src.raw()) + src_begin * element, src.dim(1) * element, width * element,
                static_cast<size_t>(dst.dim(0)), dst.device());
}

void check_shape(const Tensor& t, const Shape& expected, const char* what) {
  FORGE_CHECK(t.shape() == expected, "{} has shape {}, expected {}", what, shape_str(t.shape()),
              shape_str(expected));
}

void check_dtype(const Tensor& t, DType expected, const char* what) {
  FORGE_CHECK(t.dtype() == expected, "{} is {}, expected {}", what, dtype_name(t.dtype()),
              dtype_name(expected));
}

}  // namespace forge
