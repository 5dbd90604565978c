// NOTE [VAE downsample padding]
// diffusers' Downsample2D with padding=0 (what the VAE's encoder builds) pads its input with
// F.pad(x, (0, 1, 0, 1)): one zero column on the right and one zero row at the bottom, none
// on the left or top, then convolves 3x3 at stride 2. Output pixel (y, x) thus reads input
// rows 2y .. 2y + 2 and columns 2x .. 2x + 2, an even H giving H / 2 rows. forge expresses
// this as Conv2dShape{3, 2, 0, 0, 1, 1}. The CPU handles any padding in its patch gather. On
// CUDA the input is padded explicitly into a scratch buffer (kernels/cuda/conv2d_padding.cu),
// and cuDNN then convolves without padding: cuDNN's graph API has separate pre- and post-
// paddings, but which engines accept unequal ones is not documented, while the explicit copy
// costs one pass over the three downsample inputs of an encode.
#include "ops/conv2d.h"

#include "core/op_profile.h"
#include "kernels/cpu/conv2d.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/bias.h"
#include "kernels/cuda/conv2d.h"
#include "kernels/cuda/scratch.h"
#endif

namespace forge {
namespace {

void check_conv_shape(const Conv2dShape& s) {
  FORGE_CHECK(s.kernel >= 1 && s.stride >= 1, "conv2d: kernel {} and stride {} must be at least 1", s.kernel,
              s.stride);
  FORGE_CHECK(s.pad_top >= 0 && s.pad_left >= 0 && s.pad_bottom >= 0 && s.pad_right >= 0,
              "conv2d: padding ({}, {}, {}, {}) must not be negative", s.pad_top, s.pad_left, s.pad_bottom,
              s.pad_right);
}

cpu::Conv2dDims dims_of(const Tensor& in, int64_t out_channels, const Conv2dShape& s) {
  return {in.dim(0), in.dim(1),  in.dim(2),   in.dim(3),    out_channels, s.kernel,
          s.stride,  s.pad_top, s.pad_left, s.pad_bottom, s.pad_right};
}

#ifdef FORGE_CUDA
// cuDNN with one padding on every side; any other padding is applied by an explicit copy
// (NOTE [VAE downsample padding]). The bias is added after the convolution.
void cuda_conv2d(const Tensor& out, const Tensor& in, const Tensor& weight, const Tensor* bias,
                 const cpu::Conv2dDims& d) {
  cuda::Conv2dProblem p{d.batch, d.height, d.width, d.in_channels, d.out_channels, d.kernel, d.stride, d.pad_top};
  const cuda::bf16* input = bf16_ptr(in);
  const bool uniform = d.pad_left == d.pad_top && d.pad_bottom == d.pad_top && d.pad_right == d.pad_top;
  if (!uniform) {
    p.height = d.pad_top + d.height + d.pad_bottom;
    p.width = d.pad_left + d.width + d.pad_right;
    p.pad = 0;
    const size_t bytes = static_cast<size_t>(p.batch * p.height * p.width * p.in_channels) * sizeof(cuda::bf16);
    auto* padded = static_cast<cuda::bf16*>(cuda::scratch_buffer(cuda::ScratchSlot::ConvPaddedInput, bytes));
    cuda::pad_nhwc(padded, input, d.batch, d.height, d.width, d.in_channels, d.pad_top, d.pad_left, d.pad_bottom,
                   d.pad_right);
    input = padded;
  }
  cuda::conv2d_forward(bf16_ptr(out), input, bf16_ptr(weight), p);
  if (bias) cuda::add_bias(bf16_ptr(out), bf16_ptr(*bias), out.numel() / d.out_channels, d.out_channels);
}
#endif

}  // namespace

Shape conv2d_out_shape(const Shape& in, int64_t out_channels, const Conv2dShape& s) {
  check_conv_shape(s);
  FORGE_CHECK(in.size() == 4, "conv2d: input {} must be [B, H, W, C]", shape_str(in));
  const int64_t h = in[1] + s.pad_top + s.pad_bottom, w = in[2] + s.pad_left + s.pad_right;
  FORGE_CHECK(h >= s.kernel && w >= s.kernel, "conv2d: a {}x{} kernel does not fit the padded {}x{} input {}",
              s.kernel, s.kernel, h, w, shape_str(in));
  return {in[0], (h - s.kernel) / s.stride + 1, (w - s.kernel) / s.stride + 1, out_channels};
}

void conv2d_forward(const Tensor& out, const Tensor& in, const Tensor& weight, const Tensor& bias,
                    const Conv2dShape& shape) {
  OpProfileScope profile(OpClass::Gemm, "conv2d_forward");
  FORGE_CHECK(weight.ndim() == 4, "conv2d_forward: weight {} must be [O, K, K, I]", shape_str(weight.shape()));
  const int64_t out_channels = weight.dim(0);
  FORGE_CHECK(out_channels > 0, "conv2d_forward: weight {} has no output channels", shape_str(weight.shape()));
  check_shape(out, conv2d_out_shape(in.shape(), out_channels, shape), "conv2d_forward out");
  check_shape(weight, {out_channels, shape.kernel, shape.kernel, in.dim(3)}, "conv2d_forward weight");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (has_bias) check_shape(bias, {out_channels}, "conv2d_forward bias");
  FORGE_CHECK(out.raw() != in.raw() || out.numel() == 0, "conv2d_forward: out must not alias in");
  const cpu::Conv2dDims d = dims_of(in, out_channels, shape);
  if (profile.active())
    profile.set_detail(fmt::format("{}x{}x{}x{} -> {} k{} s{}", d.batch, d.height, d.width, d.in_channels,
                                   out_channels, d.kernel, d.stride));
  if (in.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "conv2d_forward out");
    expect_tensor(in, Device::CUDA, DType::BF16, "conv2d_forward in");
    expect_tensor(weight, Device::CUDA, DType::BF16, "conv2d_forward weight");
    if (has_bias) expect_tensor(bias, Device::CUDA, DType::BF16, "conv2d_forward bias");
    FORGE_CUDA_CALL("conv2d_forward", cuda_conv2d(out, in, weight, has_bias ? &bias : nullptr, d));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "conv2d_forward out");
  expect_tensor(in, Device::CPU, DType::F32, "conv2d_forward in");
  expect_tensor(weight, Device::CPU, DType::F32, "conv2d_forward weight");
  if (has_bias) expect_tensor(bias, Device::CPU, DType::F32, "conv2d_forward bias");
  cpu::conv2d_forward(out.data<float>(), in.data<float>(), weight.data<float>(),
                      has_bias ? bias.data<float>() : nullptr, d);
}

}  // namespace forge
