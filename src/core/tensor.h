// Tensor: a typed, shaped view of a buffer on one device.
//
// NOTE [Contiguous tensors]
// Every Tensor is dense and row-major. Views only narrow the first dimension or reshape,
// so no op has to handle strides: the model keeps its activations in the layouts the ops
// want ([tokens, features], attention as [batch, seq, heads, head_dim]) and GEMMs express
// transposes through their flags instead of materializing them.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace forge {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);
int64_t shape_numel(const Shape& shape);
// The element count, or nothing when it overflows int64_t.
std::optional<int64_t> checked_numel(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(Shape shape, DType dtype = DType::F32, Device device = Device::CPU);
  static Tensor zeros(Shape shape, DType dtype = DType::F32, Device device = Device::CPU);
  // A non-owning view of memory someone else keeps alive (an mmap, an arena slice).
  static Tensor wrap(void* data, Shape shape, DType dtype, Device device = Device::CPU);

  bool defined() const { return data_ != nullptr || numel() == 0; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* raw() const { return data_; }
  template <typename T> T* data() const {
    FORGE_CHECK(dtype_of<T>() == dtype_, "tensor holds {}, accessed as {}", dtype_name(dtype_),
                dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }

  // Same storage, new shape with the same element count.
  Tensor view(Shape shape) const;
  // Rows [begin, end) of the first dimension, sharing storage.
  Tensor narrow(int64_t begin, int64_t end) const;

  void fill_zero() const;
  // Deep copy (same device).
  Tensor clone() const;
  // Deep copy onto `device`.
  Tensor to(Device device) const;
  void copy_from(const Tensor& src) const;

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

// A block of columns from one matrix into another: dst[i, dst_begin + j] = src[i, src_begin
// + j] for every row i and j < width (elements). dst and src are 2-D, with the same rows,
// dtype and device, and do not overlap; on CUDA the copy is enqueued on the legacy default
// stream. The strided copy that takes heads out of a packed tensor, or puts chunks of
// rows in another order (NOTE [Contiguous tensors]: the one place a layout is strided is
// a copy).
void copy_columns(const Tensor& dst, int64_t dst_begin, const Tensor& src, int64_t src_begin, int64_t width);

// Shape and dtype assertions used by ops on their arguments.
void check_shape(const Tensor& t, const Shape& expected, const char* what);
void check_dtype(const Tensor& t, DType expected, const char* what);

}  // namespace forge
