#include "ops/fp8_linear.h"

#include <vector>

#include "core/op_profile.h"
#include "kernels/cpu/fp8_scaling.h"
#include "ops/matmul.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/fp8_cast.h"
#include "kernels/cuda/fp8_matmul.h"
#endif

namespace forge {
namespace {

constexpr Fp8Format kE4M3 = Fp8Format::E4M3;

void check_matrices(const Tensor& out, const Tensor& a, const Tensor& b, const char* op) {
  FORGE_CHECK(out.ndim() == 2 && a.ndim() == 2 && b.ndim() == 2, "{}: operands must be matrices, got {}, {} and {}", op,
              shape_str(out.shape()), shape_str(a.shape()), shape_str(b.shape()));
}

// ---- CPU reference ----

// A row-major fp32 tensor quantized tensorwise, its codes decoded back to fp32 (exact:
// every FP8 value is an fp32 value), and the inverse of its scale, the GEMM's factor.
struct HostFp8 {
  Tensor decoded;
  float scale_inv = 1.0f;
};

HostFp8 quantize_host(const Tensor& t, Fp8Format format) {
  const int64_t rows = t.dim(0), cols = t.dim(1);
  const cpu::Fp8Blocks whole{rows, cols};
  float amax = 0.0f;
  cpu::fp8_block_amax(t.data<float>(), rows, cols, whole, &amax);
  const float scale = cpu::fp8_scale_torchao(amax, format, /*round_to_power_of_2=*/false);
  std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
  cpu::fp8_quantize(t.data<float>(), rows, cols, whole, &scale, format, codes.data());
  HostFp8 q{Tensor::empty(t.shape()), 1.0f / scale};
  cpu::fp8_to_float(codes.data(), t.numel(), format, q.decoded.data<float>());
  return q;
}

// out = op(a) op(b) x (a.scale_inv x b.scale_inv) + beta x out: the decoded codes'
// products are exact in fp32 and summed in fp32, then scaled once, as the GPU's FP8 GEMM
// does (the same up to summation order; fp8_matmul_reference in double agrees to fp32
// rounding).
void host_gemm(const Tensor& out, const HostFp8& a, bool transpose_a, const HostFp8& b, bool transpose_b,
               float beta) {
  matmul(out, a.decoded, transpose_a, b.decoded, transpose_b, a.scale_inv * b.scale_inv, beta);
}

void expect_cpu(const Tensor& t, const char* what) { expect_tensor(t, Device::CPU, DType::F32, what); }

#ifdef FORGE_CUDA
// ---- CUDA ----

struct DeviceOperand {
  uint8_t* codes;
  float* amax;
  float* scale;
  float* scale_inv;
};

DeviceOperand operand(const Fp8LinearWorkspace& ws, int which, int64_t bytes, const char* op) {
  const Tensor& codes = which == 0 ? ws.a_codes : ws.b_codes;
  FORGE_CHECK(codes.numel() >= bytes, "{}: the FP8 workspace holds {} codes, this layer needs {}", op, codes.numel(),
              bytes);
  float* stats = ws.stats.data<float>() + 3 * which;
  return {codes.data<uint8_t>(), stats, stats + 1, stats + 2};
}

const Fp8LinearWorkspace& workspace_of(const Fp8Linear& fp8, const char* op) {
  FORGE_CHECK(fp8.workspace && fp8.workspace->a_codes.device() == Device::CUDA,
              "{}: an FP8 layer on CUDA needs a device workspace", op);
  return *fp8.workspace;
}

const cuda::bf16* bf16_of(const Tensor& t) { return static_cast<const cuda::bf16*>(t.raw()); }

// The codes of t [rows, cols] (bf16) at `dst`, transposed to [cols, rows] when asked.
void quantize_device(const Tensor& t, Fp8Format format, bool transpose, const DeviceOperand& dst) {
  const int64_t rows = t.dim(0), cols = t.dim(1);
  if (!transpose) {
    cuda::fp8_quantize_tensorwise(bf16_of(t), t.numel(), format, false, dst.codes, dst.amax, dst.scale, dst.scale_inv);
    return;
  }
  cuda::fp8_amax(bf16_of(t), t.numel(), dst.amax);
  cuda::fp8_scale_from_amax(dst.amax, format, false, dst.scale, dst.scale_inv);
  cuda::fp8_cast_transpose(bf16_of(t), rows, cols, dst.scale, format, nullptr, dst.codes, nullptr);
}

cuda::Fp8GemmOperand gemm_operand(const DeviceOperand& d, Fp8Format format) {
  return {d.codes, format, d.scale_inv, cuda::Fp8GemmScaling::Tensor};
}
#endif

}  // namespace

void fp8_linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Fp8Linear& fp8,
                        const Tensor* residual) {
  OpProfileScope profile(OpClass::Gemm, "fp8_linear_forward");
  check_matrices(y, x, w, "fp8_linear_forward");
  const int64_t t = x.dim(0), in = x.dim(1), out = w.dim(0);
  FORGE_CHECK(w.dim(1) == in, "fp8_linear_forward: x {} and W {} disagree on in_features", shape_str(x.shape()),
              shape_str(w.shape()));
  check_shape(y, {t, out}, "fp8_linear_forward y");
  if (residual) check_shape(*residual, y.shape(), "fp8_linear_forward residual");
  if (x.device() == Device::CUDA) {
    FORGE_CUDA_CALL("fp8_linear_forward", [&] {
      for (const Tensor* p : {&y, &x, &w}) expect_tensor(*p, Device::CUDA, DType::BF16, "fp8_linear_forward");
      if (residual) expect_tensor(*residual, Device::CUDA, DType::BF16, "fp8_linear_forward residual");
      const Fp8LinearWorkspace& ws = workspace_of(fp8, "fp8_linear_forward");
      const DeviceOperand a = operand(ws, 0, t * in, "fp8_linear_forward"), b = operand(ws, 1, out * in, "fp8_linear_forward");
      quantize_device(x, kE4M3, false, a);
      quantize_device(w, kE4M3, false, b);
      if (residual && residual->raw() != y.raw()) y.copy_from(*residual);
      cuda::fp8_matmul(y.raw(), DType::BF16, gemm_operand(a, kE4M3), gemm_operand(b, kE4M3), t, out, in, 1.0f,
                       residual ? 1.0f : 0.0f, /*fast_accumulation=*/true);
    }());
    return;
  }
  expect_cpu(y, "fp8_linear_forward y");
  expect_cpu(x, "fp8_linear_forward x");
  expect_cpu(w, "fp8_linear_forward W");
  if (residual) expect_cpu(*residual, "fp8_linear_forward residual");
  const HostFp8 xq = quantize_host(x, kE4M3), wq = quantize_host(w, kE4M3);
  if (residual && residual->raw() != y.raw()) y.copy_from(*residual);
  host_gemm(y, xq, false, wq, true, residual ? 1.0f : 0.0f);
}

void fp8_linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, const Fp8Linear& fp8) {
  OpProfileScope profile(OpClass::Gemm, "fp8_linear_backward_input");
  check_matrices(dx, dy, w, "fp8_linear_backward_input");
  const int64_t t = dy.dim(0), out = dy.dim(1), in = w.dim(1);
  FORGE_CHECK(w.dim(0) == out, "fp8_linear_backward_input: dy {} and W {} disagree on out_features",
              shape_str(dy.shape()), shape_str(w.shape()));
  check_shape(dx, {t, in}, "fp8_linear_backward_input dx");
  if (dy.device() == Device::CUDA) {
    FORGE_CUDA_CALL("fp8_linear_backward_input", [&] {
      for (const Tensor* p : {&dx, &dy, &w}) expect_tensor(*p, Device::CUDA, DType::BF16, "fp8_linear_backward_input");
      const Fp8LinearWorkspace& ws = workspace_of(fp8, "fp8_linear_backward_input");
      const DeviceOperand a = operand(ws, 0, t * out, "fp8_linear_backward_input"),
                          b = operand(ws, 1, out * in, "fp8_linear_backward_input");
      quantize_device(dy, fp8.grad_format, false, a);
      quantize_device(w, kE4M3, /*transpose=*/true, b);  // W^T [in, out]
      cuda::fp8_matmul(dx.raw(), DType::BF16, gemm_operand(a, fp8.grad_format), gemm_operand(b, kE4M3), t, in, out,
                       1.0f, 0.0f, false);
    }());
    return;
  }
  expect_cpu(dx, "fp8_linear_backward_input dx");
  expect_cpu(dy, "fp8_linear_backward_input dy");
  expect_cpu(w, "fp8_linear_backward_input W");
  host_gemm(dx, quantize_host(dy, fp8.grad_format), false, quantize_host(w, kE4M3), false, 0.0f);
}

void fp8_linear_backward_weight(const Tensor& grad, const Tensor& dy, const Tensor& x, const Fp8Linear& fp8,
                                bool overwrite) {
  OpProfileScope profile(OpClass::Gemm, "fp8_linear_backward_weight");
  check_matrices(grad, dy, x, "fp8_linear_backward_weight");
  const int64_t t = dy.dim(0), out = dy.dim(1), in = x.dim(1);
  FORGE_CHECK(x.dim(0) == t, "fp8_linear_backward_weight: dy {} and x {} disagree on tokens", shape_str(dy.shape()),
              shape_str(x.shape()));
  check_shape(grad, {out, in}, "fp8_linear_backward_weight dW");
  if (dy.device() == Device::CUDA) {
    FORGE_CUDA_CALL("fp8_linear_backward_weight", [&] {
      expect_tensor(grad, Device::CUDA, DType::F32, "fp8_linear_backward_weight dW");
      expect_tensor(dy, Device::CUDA, DType::BF16, "fp8_linear_backward_weight dy");
      expect_tensor(x, Device::CUDA, DType::BF16, "fp8_linear_backward_weight x");
      const Fp8LinearWorkspace& ws = workspace_of(fp8, "fp8_linear_backward_weight");
      const DeviceOperand a = operand(ws, 0, t * out, "fp8_linear_backward_weight"),
                          b = operand(ws, 1, t * in, "fp8_linear_backward_weight");
      quantize_device(dy, fp8.grad_format, true, a);  // dy^T [out, t]
      quantize_device(x, kE4M3, true, b);             // x^T [in, t]
      cuda::fp8_matmul(grad.raw(), DType::F32, gemm_operand(a, fp8.grad_format), gemm_operand(b, kE4M3), out, in, t,
                       1.0f, overwrite ? 0.0f : 1.0f, false);
    }());
    return;
  }
  expect_cpu(grad, "fp8_linear_backward_weight dW");
  expect_cpu(dy, "fp8_linear_backward_weight dy");
  expect_cpu(x, "fp8_linear_backward_weight x");
  host_gemm(grad, quantize_host(dy, fp8.grad_format), true, quantize_host(x, kE4M3), false, overwrite ? 0.0f : 1.0f);
}

}  // namespace forge
