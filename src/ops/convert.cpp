#include "ops/convert.h"

#include "core/error.h"
#include "ops/elementwise.h"

namespace forge {

void copy_converted(const Tensor& dst, const Tensor& src) {
  FORGE_CHECK(dst.numel() == src.numel(), "copy_converted: {} {} into {} {}", dtype_name(src.dtype()),
              shape_str(src.shape()), dtype_name(dst.dtype()), shape_str(dst.shape()));
  if (dst.device() == src.device()) {
    cast(dst, src);
  } else if (dst.dtype() == src.dtype()) {
    dst.copy_from(src);
  } else if (src.device() == Device::CPU) {
    cast(dst, src.to(dst.device()));
  } else {
    const Tensor staged = Tensor::empty(src.shape(), dst.dtype(), src.device());
    cast(staged, src);
    dst.copy_from(staged);
  }
}

Tensor converted(const Tensor& t, Device device, DType dtype) {
  if (t.device() == device && t.dtype() == dtype) return t;
  const Tensor out = Tensor::empty(t.shape(), dtype, device);
  copy_converted(out, t);
  return out;
}

}  // namespace forge
