#include "ops/fp8_weight_chunk.h"

#include <cmath>

#include "core/error.h"
#include "kernels/cpu/fp8_scaling.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/fp8_weight_chunk.h"
#endif

namespace forge {
namespace {

constexpr auto kE4M3 = cpu::Fp8Format::E4M3;

void expect_chunk(const Tensor& chunk, const char* op) {
  FORGE_CHECK(chunk.dtype() == DType::F32, "{}: the master chunk must be fp32, got {}",
              op, dtype_name(chunk.dtype()));
}

void expect_f32(const Tensor& t, Device device, int64_t at_least, const char* op, const char* what) {
  FORGE_CHECK(t.dtype() == DType::F32 && t.device() == device && t.numel() >= at_least,
              "{}: {} must be {} fp32 values on the chunk's device", op, what, at_least);
}

}  // namespace

void fp8_chunk_amax(const Tensor& amax, const Tensor& chunk, CudaStream stream) {
  expect_chunk(chunk, "fp8_chunk_amax");
  expect_f32(amax, chunk.device(), 1, "fp8_chunk_amax", "amax");
  if (chunk.device() == Device::CUDA) {
#ifdef FORGE_CUDA
    cuda::fp8_chunk_amax(chunk.data<float>(), chunk.numel(), amax.data<float>(), stream);
#endif
    return;
  }
  (void)stream;
  float a = 0.0f;
  if (chunk.numel() > 0) cpu::fp8_block_amax(chunk.data<float>(), 1, chunk.numel(), {1, chunk.numel()}, &a);
  *amax.data<float>() = a;
}

void fp8_chunk_scales(const Tensor& scales, const Tensor& amax, CudaStream stream) {
  const int64_t count = amax.numel(), stride = cpu::kFp8StatStride;
  expect_f32(amax, amax.device(), count, "fp8_chunk_scales", "amax");
  expect_f32(scales, amax.device(), 2 * count * stride, "fp8_chunk_scales", "scales");
  if (amax.device() == Device::CUDA) {
#ifdef FORGE_CUDA
    cuda::fp8_chunk_scales(amax.data<float>(), count, scales.data<float>(), scales.data<float>() + stride,
                           2 * stride, stream);
#endif
    return;
  }
  for (int64_t k = 0; k < count; ++k) {
    const float s = cpu::fp8_scale_torchao(amax.data<float>()[k], kE4M3, /*round_to_power_of_2=*/false);
    scales.data<float>()[2 * k * stride] = s;
    scales.data<float>()[(2 * k + 1) * stride] = 1.0f / s;
  }
}

void fp8_chunk_cast(const Tensor& codes, const Tensor& chunk, const Tensor& scale, const Tensor& amax,
                    CudaStream stream) {
  expect_chunk(chunk, "fp8_chunk_cast");
  FORGE_CHECK(codes.dtype() == DType::U8 && codes.numel() == chunk.numel() && codes.device() == chunk.device(),
              "fp8_chunk_cast: codes must be {} bytes on the chunk's device", chunk.numel());
  expect_f32(scale, chunk.device(), 1, "fp8_chunk_cast", "scale");
  if (amax.defined()) expect_f32(amax, chunk.device(), 1, "fp8_chunk_cast", "amax");
  if (chunk.device() == Device::CUDA) {
#ifdef FORGE_CUDA
    cuda::fp8_chunk_cast(chunk.data<float>(), chunk.numel(), scale.data<float>(), codes.data<uint8_t>(),
                         amax.defined() ? amax.data<float>() : nullptr, stream);
#endif
    return;
  }
  const int64_t n = chunk.numel();
  if (n == 0) return;
  cpu::fp8_quantize(chunk.data<float>(), 1, n, {1, n}, scale.data<float>(), kE4M3, codes.data<uint8_t>());
  if (!amax.defined()) return;
  float a = 0.0f;
  cpu::fp8_block_amax(chunk.data<float>(), 1, n, {1, n}, &a);
  float& seen = *amax.data<float>();
  if (!std::isnan(seen) && (std::isnan(a) || a > seen)) seen = a;
}

void fp8_transpose_codes(const Tensor& out, const Tensor& in, CudaStream stream) {
  FORGE_CHECK(in.ndim() == 2 && in.dtype() == DType::U8 && out.dtype() == DType::U8 &&
                  out.numel() == in.numel() && out.device() == in.device(),
              "fp8_transpose_codes: U8 [rows, cols] into as many bytes, got {} into {}",
              shape_str(in.shape()), shape_str(out.shape()));
  const int64_t rows = in.dim(0), cols = in.dim(1);
  if (in.device() == Device::CUDA) {
#ifdef FORGE_CUDA
    cuda::fp8_transpose_codes(in.data<uint8_t>(), rows, cols, out.data<uint8_t>(), stream);
#endif
    return;
  }
  (void)stream;
  const uint8_t* src = in.data<uint8_t>();
  uint8_t* dst = out.data<uint8_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

}  // namespace forge
