#include "ops/elementwise.h"

#include "core/bf16.h"
#include "kernels/cpu/elementwise.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/elementwise.h"
#endif

namespace forge {
namespace {

void check_same(const Tensor& a, const Tensor& b, const char* op) {
  FORGE_CHECK(a.numel() == b.numel(), "{}: {} vs {}", op, shape_str(a.shape()), shape_str(b.shape()));
  FORGE_CHECK(a.device() == b.device(), "{}: tensors on different devices", op);
  FORGE_CHECK(a.dtype() == b.dtype(), "{}: {} vs {}", op, dtype_name(a.dtype()), dtype_name(b.dtype()));
  if (a.device() == Device::CPU) check_dtype(a, DType::F32, op);
}

#ifdef FORGE_CUDA
cuda::bf16* bf16_ptr(const Tensor& t) { return static_cast<cuda::bf16*>(t.raw()); }
#endif

}  // namespace

void add_inplace(const Tensor& a, const Tensor& b) {
  OpProfileScope profile(OpClass::Elementwise, "add_inplace");
  check_same(a, b, "add_inplace");
  if (a.device() == Device::CPU) return cpu::add_inplace(a, b);
  if (a.dtype() == DType::BF16) {
    FORGE_CUDA_CALL("add_inplace", cuda::add_inplace(bf16_ptr(a), bf16_ptr(b), a.numel()));
  } else {
    check_dtype(a, DType::F32, "add_inplace");
    FORGE_CUDA_CALL("add_inplace", cuda::add_inplace(a.data<float>(), b.data<float>(), a.numel()));
  }
}

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
  OpProfileScope profile(OpClass::Elementwise, "add");
  check_same(out, a, "add");
  check_same(a, b, "add");
  if (a.device() == Device::CPU) return cpu::add(out, a, b);
  check_dtype(a, DType::BF16, "add");
  FORGE_CUDA_CALL("add", cuda::add(bf16_ptr(out), bf16_ptr(a), bf16_ptr(b), a.numel()));
}

void scale_inplace(const Tensor& a, float s) {
  OpProfileScope profile(OpClass::Elementwise, "scale_inplace");
  check_dtype(a, DType::F32, "scale_inplace");
  if (a.device() == Device::CPU) return cpu::scale_inplace(a, s);
  FORGE_CUDA_CALL("scale_inplace", cuda::scale_inplace(a.data<float>(), s, a.numel()));
}

double sum_of_squares(const Tensor& a) {
  OpProfileScope profile(OpClass::Elementwise, "sum_of_squares");
  check_dtype(a, DType::F32, "sum_of_squares");
  if (a.device() == Device::CPU) return cpu::sum_of_squares(a);
  FORGE_CUDA_CALL("sum_of_squares", return cuda::sum_of_squares(a.data<float>(), a.numel()));
}

void cast(const Tensor& out, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "cast");
  FORGE_CHECK(out.numel() == in.numel() && out.device() == in.device(), "cast: {} {} into {} {}",
              device_name(in.device()), shape_str(in.shape()), device_name(out.device()), shape_str(out.shape()));
  if (out.dtype() == in.dtype()) return out.copy_from(in);
  if (in.device() == Device::CPU) {
    if (in.dtype() == DType::F32 && out.dtype() == DType::BF16) {
      const float* src = in.data<float>();
      BFloat16* dst = out.data<BFloat16>();
      for (int64_t i = 0; i < in.numel(); ++i) dst[i] = to_bf16(src[i]);
      return;
    }
    check_dtype(in, DType::BF16, "cast input");
    check_dtype(out, DType::F32, "cast output");
    const BFloat16* src = in.data<BFloat16>();
    float* dst = out.data<float>();
    for (int64_t i = 0; i < in.numel(); ++i) dst[i] = to_float(src[i]);
    return;
  }
  if (in.dtype() == DType::F32) {
    check_dtype(out, DType::BF16, "cast output");
    FORGE_CUDA_CALL("cast", cuda::cast(bf16_ptr(out), in.data<float>(), in.numel()));
  } else {
    check_dtype(in, DType::BF16, "cast input");
    check_dtype(out, DType::F32, "cast output");
    FORGE_CUDA_CALL("cast", cuda::cast(out.data<float>(), bf16_ptr(in), in.numel()));
  }
}

}  // namespace forge
