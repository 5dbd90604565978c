#include "ops/elementwise.h"

#include "core/bf16.h"
#include "kernels/cpu/elementwise.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/elementwise.h"
#endif

namespace forge {

double sum_of_squares(const Tensor& a) {
  OpProfileScope profile(OpClass::Elementwise, "sum_of_squares");
  check_dtype(a, DType::F32, "sum_of_squares");
  if (a.device() == Device::CPU) return cpu::sum_of_squares(a);
  FORGE_CUDA_CALL("sum_of_squares", return cuda::sum_of_squares(a.data<float>(), a.numel()));
}

void cast(const Tensor& out, const Tensor& in, CudaStream stream) {
  OpProfileScope profile(OpClass::Elementwise, "cast");
  FORGE_CHECK(out.numel() == in.numel() && out.device() == in.device(), "cast: {} {} into {} {}",
              device_name(in.device()), shape_str(in.shape()), device_name(out.device()), shape_str(out.shape()));
  // The same dtype: a copy, in the stream's order too (a frozen FSDP chunk's gather).
  if (out.dtype() == in.dtype())
    return copy_bytes_on(out.raw(), out.device(), in.raw(), in.device(), out.nbytes(), stream);
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
    FORGE_CUDA_CALL("cast", cuda::cast(bf16_ptr(out), in.data<float>(), in.numel(), stream));
  } else {
    check_dtype(in, DType::BF16, "cast input");
    check_dtype(out, DType::F32, "cast output");
    FORGE_CUDA_CALL("cast", cuda::cast(out.data<float>(), bf16_ptr(in), in.numel(), stream));
  }
}

void accumulate(const Tensor& dst, const Tensor& src, CudaStream stream) {
  OpProfileScope profile(OpClass::Elementwise, "accumulate");
  FORGE_CHECK(dst.numel() == src.numel() && dst.device() == src.device(), "accumulate: {} {} into {} {}",
              device_name(src.device()), shape_str(src.shape()), device_name(dst.device()), shape_str(dst.shape()));
  const bool bf16 = dst.dtype() == DType::BF16;
  const bool into_f32 = dst.dtype() == DType::F32 && (src.dtype() == DType::F32 || src.dtype() == DType::BF16);
  FORGE_CHECK(bf16 ? src.dtype() == DType::BF16 : into_f32,
              "accumulate: {} into {}, expected f32 or bf16 into f32, or bf16 into bf16", dtype_name(src.dtype()),
              dtype_name(dst.dtype()));
  if (dst.device() == Device::CPU) {
    if (bf16) {
      BFloat16* d = dst.data<BFloat16>();
      const BFloat16* s = src.data<BFloat16>();
      for (int64_t i = 0; i < dst.numel(); ++i) d[i] = to_bf16(to_float(d[i]) + to_float(s[i]));
      return;
    }
    float* d = dst.data<float>();
    if (src.dtype() == DType::F32) {
      const float* s = src.data<float>();
      for (int64_t i = 0; i < dst.numel(); ++i) d[i] += s[i];
    } else {
      const BFloat16* s = src.data<BFloat16>();
      for (int64_t i = 0; i < dst.numel(); ++i) d[i] += to_float(s[i]);
    }
    return;
  }
  if (bf16)
    FORGE_CUDA_CALL("accumulate", cuda::accumulate(bf16_ptr(dst), bf16_ptr(src), dst.numel(), stream));
  else if (src.dtype() == DType::F32)
    FORGE_CUDA_CALL("accumulate", cuda::accumulate(dst.data<float>(), src.data<float>(), dst.numel(), stream));
  else
    FORGE_CUDA_CALL("accumulate", cuda::accumulate(dst.data<float>(), bf16_ptr(src), dst.numel(), stream));
}

}  // namespace forge
