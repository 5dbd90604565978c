#include "ops/elementwise.h"

#include "kernels/cpu/elementwise.h"

namespace forge {
namespace {

void check_same(const Tensor& a, const Tensor& b, const char* op) {
  FORGE_CHECK(a.numel() == b.numel(), "{}: {} vs {}", op, shape_str(a.shape()), shape_str(b.shape()));
  FORGE_CHECK(a.device() == b.device(), "{}: tensors on different devices", op);
  FORGE_CHECK(a.device() == Device::CPU, "{}: no CUDA kernel in this build", op);
}

}  // namespace

void add_inplace(const Tensor& a, const Tensor& b) {
  check_same(a, b, "add_inplace");
  cpu::add_inplace(a, b);
}

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
  check_same(out, a, "add");
  check_same(a, b, "add");
  cpu::add(out, a, b);
}

void scale_inplace(const Tensor& a, float s) {
  FORGE_CHECK(a.device() == Device::CPU, "scale_inplace: no CUDA kernel in this build");
  cpu::scale_inplace(a, s);
}

double sum_of_squares(const Tensor& a) {
  FORGE_CHECK(a.device() == Device::CPU, "sum_of_squares: no CUDA kernel in this build");
  return cpu::sum_of_squares(a);
}

}  // namespace forge
