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

#ifdef FORGE_CUDA
cuda::bf16* bf16_ptr(const Tensor& t) { return static_cast<cuda::bf16*>(t.raw()); }
#endif

}  // namespace

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
