#include "ops/fp8_linear.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/op_profile.h"
#include "kernels/cpu/fp8_scaling.h"
#include "ops/matmul.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/fp8_cast.h"
#include "kernels/cuda/fp8_matmul.h"
#include "kernels/cuda/fp8_padding.h"
#include "kernels/cuda/fp8_weight_chunk.h"
#endif

namespace forge {
namespace {

constexpr Fp8Format kE4M3 = Fp8Format::E4M3;
using cpu::Fp8Role;

void check_matrices(const Tensor& out, const Tensor& a, const Tensor& b, const char* op) {
  FORGE_CHECK(out.ndim() == 2 && a.ndim() == 2 && b.ndim() == 2, "{}: operands must be matrices, got {}, {} and {}", op,
              shape_str(out.shape()), shape_str(a.shape()), shape_str(b.shape()));
}

// ---- CPU reference ----

void expect_cpu(const Tensor& t, const char* what) { expect_tensor(t, Device::CPU, DType::F32, what); }

// A row-major fp32 tensor quantized tensorwise, its codes decoded back to fp32 (exact:
// every FP8 value is an fp32 value), and the inverse of its scale, the GEMM's factor.
struct HostFp8 {
  Tensor decoded;
  float scale_inv = 1.0f;
};

// With the projection's statistics: t's amax folded into the role's seen (NaN winning, as
// the GPU's integer maximum), and with `delayed` the block's scale instead of t's own.
HostFp8 quantize_host(const Tensor& t, Fp8Format format, const Fp8Linear& fp8, Fp8Role role) {
  const int64_t rows = t.dim(0), cols = t.dim(1);
  const cpu::Fp8Blocks whole{rows, cols};
  float amax = 0.0f;
  cpu::fp8_block_amax(t.data<float>(), rows, cols, whole, &amax);
  if (float* seen = fp8_seen_of(fp8, role); seen && !std::isnan(*seen) && (std::isnan(amax) || amax > *seen)) *seen = amax;
  const bool delayed = fp8_uses_delayed_scales(fp8);
  // The rank's own amax is in its seen (a NaN there whatever the reduction does with it).
  if (Fp8AmaxGroup* group = fp8_amax_group_of(fp8, role); group && !delayed)
    group->all_reduce_max(Tensor::wrap(&amax, {1}, DType::F32, Device::CPU));
  const float scale = delayed ? fp8.stats[cpu::fp8_scale_offset(0, role)]
                              : cpu::fp8_scale_torchao(amax, format, /*round_to_power_of_2=*/false);
  std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
  cpu::fp8_quantize(t.data<float>(), rows, cols, whole, &scale, format, codes.data());
  HostFp8 q{Tensor::empty(t.shape()), delayed ? fp8.stats[cpu::fp8_scale_inv_offset(0, role)] : 1.0f / scale};
  cpu::fp8_to_float(codes.data(), t.numel(), format, q.decoded.data<float>());
  return q;
}

// NOTE [FP8 gathered weights]: the gathered codes decoded, their amax folded into W's seen.
HostFp8 gathered_host(const Tensor& codes, const Fp8GatheredWeight& g, const Fp8Linear& fp8) {
  expect_tensor(codes, Device::CPU, DType::U8, "FP8 gathered weight codes");
  if (float* seen = fp8_seen_of(fp8, Fp8Role::W); seen && !std::isnan(*seen) && (std::isnan(*g.amax) || *g.amax > *seen))
    *seen = *g.amax;
  HostFp8 q{Tensor::empty(codes.shape()), *g.scale_inv};
  cpu::fp8_to_float(codes.data<uint8_t>(), codes.numel(), kE4M3, q.decoded.data<float>());
  return q;
}

// W quantized for the reference: cast here, or the gathered codes.
HostFp8 weight_host(const Tensor& w, const Fp8Linear& fp8, const Fp8GatheredWeight* gathered) {
  if (gathered) return gathered_host(w, *gathered, fp8);
  expect_cpu(w, "FP8 linear W");
  return quantize_host(w, kE4M3, fp8, Fp8Role::W);
}

// out = op(a) op(b) x (a.scale_inv x b.scale_inv) + beta x out: the decoded codes'
// products are exact in fp32 and summed in fp32, then scaled once, as the GPU's FP8 GEMM
// does (the same up to summation order; fp8_matmul_reference in double agrees to fp32
// rounding).
void host_gemm(const Tensor& out, const HostFp8& a, bool transpose_a, const HostFp8& b, bool transpose_b,
               float beta) {
  matmul(out, a.decoded, transpose_a, b.decoded, transpose_b, a.scale_inv * b.scale_inv, beta);
}


#ifdef FORGE_CUDA
// ---- CUDA ----

struct DeviceOperand {
  uint8_t* codes;
  float* amax;
  float* scale;
  float* scale_inv;
};

// Operand 0 (codes in a_codes) and 1 (b_codes) each have their own statistics; operand 2
// is dy's transpose in c_codes, quantized with operand 0's statistics.
DeviceOperand operand(const Fp8LinearWorkspace& ws, int which, int64_t bytes, const char* op) {
  const Tensor& codes = which == 0 ? ws.a_codes : which == 1 ? ws.b_codes : ws.c_codes;
  FORGE_CHECK(codes.numel() >= bytes, "{}: the FP8 workspace holds {} codes, this layer needs {}", op, codes.numel(),
              bytes);
  FORGE_CHECK(ws.stats.numel() >= kFp8WorkspaceStats, "{}: the FP8 workspace holds {} statistics, expected {}", op,
              ws.stats.numel(), kFp8WorkspaceStats);
  float* stats = ws.stats.data<float>() + 3 * (which % 2) * kFp8StatStride;
  return {codes.data<uint8_t>(), stats, stats + kFp8StatStride, stats + 2 * kFp8StatStride};
}

const Fp8LinearWorkspace& workspace_of(const Fp8Linear& fp8, const char* op) {
  FORGE_CHECK(fp8.workspace && fp8.workspace->a_codes.device() == Device::CUDA,
              "{}: an FP8 layer on CUDA needs a device workspace", op);
  return *fp8.workspace;
}

// The codes of t [rows, cols] (bf16) at `dst` with its current scale, transposed to
// [cols, rows] when asked; t's amax folded into `seen` when not null.
// With amax_ready, t's amax is in dst.amax already (NOTE [FP8 fused producers]).
// With a group, the amax is max-reduced over it before the scale (NOTE [FP8 under tensor
// parallelism] in model/fp8_projections.h), the rank's own folded into `seen` first.
void agree_amax(Fp8AmaxGroup* group, float* amax, float* seen) {
  if (!group) return;
  if (seen) cuda::fp8_fold_amax(amax, seen, nullptr);
  group->all_reduce_max(Tensor::wrap(amax, {1}, DType::F32, Device::CUDA));
}

void quantize_device(const Tensor& t, Fp8Format format, bool transpose, const DeviceOperand& dst, float* seen,
                     Fp8AmaxGroup* group, bool amax_ready = false) {
  const int64_t rows = t.dim(0), cols = t.dim(1);
  if (!amax_ready) cuda::fp8_amax(bf16_ptr(t), t.numel(), dst.amax);
  agree_amax(group, dst.amax, seen);
  cuda::fp8_scale_from_amax(dst.amax, format, false, dst.scale, dst.scale_inv, seen);
  if (transpose) cuda::fp8_cast_transpose(bf16_ptr(t), rows, cols, dst.scale, format, nullptr, dst.codes, nullptr);
  else cuda::fp8_cast(bf16_ptr(t), t.numel(), dst.scale, format, dst.codes, nullptr);
}

// NOTE [FP8 fused producers]: whether a producer prepared x (its amax, or with `codes` its
// codes) for this forward; the record is used once.
bool produced_input(const Fp8Linear& fp8, const Tensor& x, bool codes) {
  Fp8Produced* p = fp8.produced;
  if (!p || p->x != x.raw() || p->x_numel != x.numel() || p->x_codes != codes) return false;
  p->x = nullptr;
  return true;
}

// Where a producer put x's codes for this forward (the workspace's `workspace_codes`, or
// the grouped expert casts' buffer), or null when it did not; used once.
uint8_t* produced_codes(const Fp8Linear& fp8, const Tensor& x, uint8_t* workspace_codes) {
  if (!fp8.produced) return nullptr;
  uint8_t* at = fp8.produced->x_codes_at ? const_cast<uint8_t*>(fp8.produced->x_codes_at) : workspace_codes;
  return produced_input(fp8, x, true) ? at : nullptr;
}

// Whether a producer folded dy's amax into the workspace's first slot; used once.
bool produced_output_gradient(const Fp8Linear& fp8, const Tensor& dy) {
  Fp8Produced* p = fp8.produced;
  if (!p || p->dy != dy.raw() || p->dy_numel != dy.numel() || p->dy_stats_at) return false;
  p->dy = nullptr;
  return true;
}

// dy's amax, scale and inverse scale where the grouped expert casts put them
// (Fp8Produced::dy_stats_at), used once; null for any other dy.
float* prepared_output_gradient_stats(const Fp8Linear& fp8, const Tensor& dy) {
  Fp8Produced* p = fp8.produced;
  if (!p || !p->dy_stats_at || p->dy != dy.raw() || p->dy_numel != dy.numel()) return nullptr;
  float* at = p->dy_stats_at;
  p->dy = nullptr;
  p->dy_stats_at = nullptr;
  return at;
}

// NOTE [FP8 delayed scaling]: the role's statistics in the projection's block, codes at `codes`.
DeviceOperand delayed_operand(const Fp8Linear& fp8, Fp8Role role, uint8_t* codes) {
  float* seen = fp8_seen_of(fp8, role);
  return {codes, seen, seen + kFp8StatStride, seen + 2 * kFp8StatStride};
}

// t's codes with the delayed scale, its amax folded into the role's seen in the same pass;
// `transpose` writes [cols, rows] instead; also_transposed, when given, takes the transpose beside the codes.
void cast_delayed(const Tensor& t, Fp8Format format, const DeviceOperand& dst, bool transpose,
                  uint8_t* also_transposed = nullptr) {
  if (!transpose && !also_transposed) {
    cuda::fp8_cast(bf16_ptr(t), t.numel(), dst.scale, format, dst.codes, dst.amax);
    return;
  }
  cuda::fp8_cast_transpose(bf16_ptr(t), t.dim(0), t.dim(1), dst.scale, format, transpose ? nullptr : dst.codes,
                           transpose ? dst.codes : also_transposed, dst.amax);
}

// NOTE [FP8 weight cache]: the cached codes of w (transposed or not) when they are this
// step's, else null.
uint8_t* cached_weight(const Fp8Linear& fp8, const Tensor& w, bool transposed) {
  const Fp8WeightCache* c = fp8.weight_cache;
  if (!c || !c->generation || c->w != w.raw() || c->numel != w.numel()) return nullptr;
  if ((transposed ? c->codes_t_of : c->codes_of) != *c->generation) return nullptr;
  return (transposed ? c->codes_t : c->codes).data<uint8_t>();
}

// Where w's codes are to be cast so that the cache keeps them (marked as this step's), or
// `fallback` without a cache that fits.
uint8_t* caching_target(const Fp8Linear& fp8, const Tensor& w, bool transposed, uint8_t* fallback) {
  Fp8WeightCache* c = fp8.weight_cache;
  if (!c || !c->generation || (transposed ? c->codes_t : c->codes).numel() < w.numel()) return fallback;
  if (c->w != w.raw() || c->numel != w.numel()) {
    c->w = w.raw();
    c->numel = w.numel();
    c->codes_of = c->codes_t_of = ~uint64_t{0};
  }
  (transposed ? c->codes_t_of : c->codes_of) = *c->generation;
  return (transposed ? c->codes_t : c->codes).data<uint8_t>();
}

// The codes of `op` with statistics slot `which` (0 x, 1 W) of a projection's forward
// statistics instead of the workspace's.
DeviceOperand with_forward_stats(DeviceOperand op, const Fp8ForwardStats& saved, int which) {
  float* stats = saved.device + 3 * which * kFp8StatStride;
  return {op.codes, stats, stats + kFp8StatStride, stats + 2 * kFp8StatStride};
}

// Whether the forward statistics are those of x and w (either may be null: not asked).
bool saw(const Fp8ForwardStats* saved, const Tensor* x, const Tensor* w) {
  if (!saved || !saved->device) return false;
  if (x && (saved->x != x->raw() || saved->x_numel != x->numel())) return false;
  if (w && (saved->w != w->raw() || saved->w_numel != w->numel())) return false;
  return true;
}

// t [rows, cols] transposed into dst's codes with the scale its forward found (no amax).
void cast_transpose_with(const Tensor& t, Fp8Format format, const DeviceOperand& dst) {
  cuda::fp8_cast_transpose(bf16_ptr(t), t.dim(0), t.dim(1), dst.scale, format, nullptr, dst.codes, nullptr);
}

// W^T (E4M3) into b's codes: with the forward's scale when it saw this W (b then points
// at those statistics), quantized afresh otherwise.
// With a known scale (delayed, or the forward's) the codes come from or go to the weight
// cache (NOTE [FP8 weight cache]).
void quantize_weight_transposed(const Tensor& w, const Fp8Linear& fp8, DeviceOperand& b) {
  const bool delayed = fp8_uses_delayed_scales(fp8);
  if (delayed) {
    b = delayed_operand(fp8, Fp8Role::W, b.codes);
  } else if (saw(fp8.forward, nullptr, &w)) {
    b = with_forward_stats(b, *fp8.forward, 1);
  } else {
    quantize_device(w, kE4M3, /*transpose=*/true, b, fp8_seen_of(fp8, Fp8Role::W), fp8_amax_group_of(fp8, Fp8Role::W));
    return;
  }
  if (uint8_t* kept = cached_weight(fp8, w, true)) {
    b.codes = kept;
    return;
  }
  b.codes = caching_target(fp8, w, true, b.codes);
  if (delayed) cast_delayed(w, kE4M3, b, /*transpose=*/true);
  else cast_transpose_with(w, kE4M3, b);
}

// x^T (E4M3) into b's codes, the same way with the forward's x statistics.
void quantize_input_transposed(const Tensor& x, const Fp8Linear& fp8, DeviceOperand& b) {
  if (fp8_uses_delayed_scales(fp8)) {
    b = delayed_operand(fp8, Fp8Role::X, b.codes);
    cast_delayed(x, kE4M3, b, /*transpose=*/true);
  } else if (saw(fp8.forward, &x, nullptr)) {
    b = with_forward_stats(b, *fp8.forward, 0);
    cast_transpose_with(x, kE4M3, b);
  } else {
    quantize_device(x, kE4M3, /*transpose=*/true, b, fp8_seen_of(fp8, Fp8Role::X), fp8_amax_group_of(fp8, Fp8Role::X));
  }
}

// dy (grad format) into d's codes: row-major for the input gradient, transposed (dy^T
// [out, t]) for the weight gradient.
void quantize_output_gradient(const Tensor& dy, const Fp8Linear& fp8, bool transpose, DeviceOperand& d) {
  if (fp8_uses_delayed_scales(fp8)) {
    d = delayed_operand(fp8, Fp8Role::Dy, d.codes);
    cast_delayed(dy, fp8.grad_format, d, transpose);
  } else {
    // A producer's amax is operand 0's (fp8_output_gradient_amax), where d's is here.
    const char* op = "quantize_output_gradient";
    const float* produced_at = operand(workspace_of(fp8, op), 0, 0, op).amax;
    quantize_device(dy, fp8.grad_format, transpose, d, fp8_seen_of(fp8, Fp8Role::Dy), fp8_amax_group_of(fp8, Fp8Role::Dy),
                    d.amax == produced_at && produced_output_gradient(fp8, dy));
  }
}

// NOTE [FP8 gathered weights]: the gathered codes as the forward's W operand, their amax
// folded into W's seen.
DeviceOperand gathered_operand(const Tensor& codes, const Fp8GatheredWeight& g, const Fp8Linear& fp8) {
  expect_tensor(codes, Device::CUDA, DType::U8, "FP8 gathered weight codes");
  if (float* seen = fp8_seen_of(fp8, Fp8Role::W)) cuda::fp8_fold_amax(g.amax, seen, nullptr);
  return {codes.data<uint8_t>(), const_cast<float*>(g.amax), const_cast<float*>(g.scale),
          const_cast<float*>(g.scale_inv)};
}

// W^T's codes [in, out] into b's: the gathered codes transposed.
void transpose_gathered(const Tensor& codes, const Fp8GatheredWeight& g, const Fp8Linear& fp8, DeviceOperand& b) {
  const DeviceOperand w = gathered_operand(codes, g, fp8);
  cuda::fp8_transpose_codes(w.codes, codes.dim(0), codes.dim(1), b.codes, nullptr);
  b = {b.codes, w.amax, w.scale, w.scale_inv};
}

cuda::Fp8GemmOperand gemm_operand(const DeviceOperand& d, Fp8Format format) {
  return {d.codes, format, d.scale_inv, cuda::Fp8GemmScaling::Tensor};
}

// The GEMM's token dimension `tokens` varies from call to call for a routed expert's
// projection (NOTE [FP8 GEMMs of varying size] in kernels/cuda/fp8_matmul.cpp).
cuda::GemmVarying varying(const Fp8Linear& fp8, cuda::GemmVarying tokens) {
  return fp8.varying_tokens ? tokens : cuda::GemmVarying::None;
}

// The CUDA path profiles its casts ("fp8_quantize", elementwise) apart from its GEMMs
// ("fp8_gemm [m x n x k]"), so that logging.profile_ops shows what FP8 costs beside what it
// saves; the CPU reference is one op.
void profiled_gemm(const char* op, int64_t m, int64_t n, int64_t k, const std::function<void()>& gemm) {
  OpProfileScope profile(OpClass::Gemm, "fp8_gemm");
  if (profile.active()) profile.set_detail(fmt::format("{} {}x{}x{}", op, m, n, k));
  gemm();
}
#endif

}  // namespace

void fp8_linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Fp8Linear& fp8,
                        const Tensor* residual, const Fp8GatheredWeight* gathered) {
  check_matrices(y, x, w, "fp8_linear_forward");
  const int64_t t = x.dim(0), in = x.dim(1), out = w.dim(0);
  FORGE_CHECK(w.dim(1) == in, "fp8_linear_forward: x {} and W {} disagree on in_features", shape_str(x.shape()),
              shape_str(w.shape()));
  check_shape(y, {t, out}, "fp8_linear_forward y");
  if (residual) check_shape(*residual, y.shape(), "fp8_linear_forward residual");
  if (x.device() == Device::CUDA) {
    FORGE_CUDA_CALL("fp8_linear_forward", [&] {
      for (const Tensor* p : {&y, &x}) expect_tensor(*p, Device::CUDA, DType::BF16, "fp8_linear_forward");
      if (!gathered) expect_tensor(w, Device::CUDA, DType::BF16, "fp8_linear_forward W");
      if (residual) expect_tensor(*residual, Device::CUDA, DType::BF16, "fp8_linear_forward residual");
      const Fp8LinearWorkspace& ws = workspace_of(fp8, "fp8_linear_forward");
      DeviceOperand a = operand(ws, 0, t * in, "fp8_linear_forward"), b = operand(ws, 1, out * in, "fp8_linear_forward");
      const bool delayed = fp8_uses_delayed_scales(fp8);
      if (delayed) {
        a = delayed_operand(fp8, Fp8Role::X, a.codes);
        b = delayed_operand(fp8, Fp8Role::W, b.codes);
      } else if (fp8.forward && fp8.forward->device) {  // kept for the backward
        a = with_forward_stats(a, *fp8.forward, 0);
        b = with_forward_stats(b, *fp8.forward, 1);
        // A gathered W's statistics travel with its codes: the backward does not look here for them.
        *fp8.forward = {fp8.forward->device, x.raw(), gathered ? nullptr : w.raw(), x.numel(), gathered ? 0 : w.numel()};
      }
      {
        OpProfileScope profile(OpClass::Elementwise, "fp8_quantize");
        // NOTE [FP8 weight cache]: W's codes and scale are this step's already, or cast into the cache.
        // Tensorwise keeps W's scale in the forward statistics, so it caches only with them.
        const bool cacheable = !gathered && (delayed || (fp8.forward && fp8.forward->device));
        uint8_t* kept = cacheable ? cached_weight(fp8, w, false) : nullptr;
        if (gathered) {
          b = gathered_operand(w, *gathered, fp8);
          kept = b.codes;
        } else if (kept) b.codes = kept;
        else if (cacheable) b.codes = caching_target(fp8, w, false, b.codes);
        if (delayed) {
          if (uint8_t* codes = produced_codes(fp8, x, a.codes)) a.codes = codes;
          else cast_delayed(x, kE4M3, a, false);
          if (!kept) cast_delayed(w, kE4M3, b, false);
        } else {
          const bool kept_stats = fp8.forward && fp8.forward->device;
          // NOTE [FP8 grouped expert casts]: x's codes and scales made already.
          if (uint8_t* codes = kept_stats ? produced_codes(fp8, x, a.codes) : nullptr) {
            a.codes = codes;
          } else {
            const bool amax_ready = kept_stats && produced_input(fp8, x, false);
            quantize_device(x, kE4M3, false, a, fp8_seen_of(fp8, Fp8Role::X), fp8_amax_group_of(fp8, Fp8Role::X),
                            amax_ready);
          }
          if (!kept) quantize_device(w, kE4M3, false, b, fp8_seen_of(fp8, Fp8Role::W), fp8_amax_group_of(fp8, Fp8Role::W));
        }
        if (residual && residual->raw() != y.raw()) y.copy_from(*residual);
      }
      profiled_gemm("forward", t, out, in, [&] {
        cuda::fp8_matmul(y.raw(), DType::BF16, gemm_operand(a, kE4M3), gemm_operand(b, kE4M3), t, out, in, 1.0f,
                         residual ? 1.0f : 0.0f, /*fast_accumulation=*/true, varying(fp8, cuda::GemmVarying::M));
      });
    }());
    return;
  }
  OpProfileScope profile(OpClass::Gemm, "fp8_linear_forward");
  expect_cpu(y, "fp8_linear_forward y");
  expect_cpu(x, "fp8_linear_forward x");
  if (residual) expect_cpu(*residual, "fp8_linear_forward residual");
  const HostFp8 xq = quantize_host(x, kE4M3, fp8, Fp8Role::X), wq = weight_host(w, fp8, gathered);
  if (residual && residual->raw() != y.raw()) y.copy_from(*residual);
  host_gemm(y, xq, false, wq, true, residual ? 1.0f : 0.0f);
}

namespace {

// dx = dy W + beta dx (beta 0 or 1).
void backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, const Fp8Linear& fp8,
                    const Fp8GatheredWeight* gathered, float beta) {
  check_matrices(dx, dy, w, "fp8_linear_backward_input");
  const int64_t t = dy.dim(0), out = dy.dim(1), in = w.dim(1);
  FORGE_CHECK(w.dim(0) == out, "fp8_linear_backward_input: dy {} and W {} disagree on out_features",
              shape_str(dy.shape()), shape_str(w.shape()));
  check_shape(dx, {t, in}, "fp8_linear_backward_input dx");
  if (dy.device() == Device::CUDA) {
    FORGE_CUDA_CALL("fp8_linear_backward_input", [&] {
      for (const Tensor* p : {&dx, &dy}) expect_tensor(*p, Device::CUDA, DType::BF16, "fp8_linear_backward_input");
      if (!gathered) expect_tensor(w, Device::CUDA, DType::BF16, "fp8_linear_backward_input W");
      const Fp8LinearWorkspace& ws = workspace_of(fp8, "fp8_linear_backward_input");
      DeviceOperand a = operand(ws, 0, t * out, "fp8_linear_backward_input");
      DeviceOperand b = operand(ws, 1, out * in, "fp8_linear_backward_input");
      {
        OpProfileScope profile(OpClass::Elementwise, "fp8_quantize");
        quantize_output_gradient(dy, fp8, /*transpose=*/false, a);
        if (gathered) transpose_gathered(w, *gathered, fp8, b);
        else quantize_weight_transposed(w, fp8, b);  // W^T [in, out]
      }
      profiled_gemm("backward_input", t, in, out, [&] {
        cuda::fp8_matmul(dx.raw(), DType::BF16, gemm_operand(a, fp8.grad_format), gemm_operand(b, kE4M3), t, in, out,
                         1.0f, beta, false, varying(fp8, cuda::GemmVarying::M));
      });
    }());
    return;
  }
  OpProfileScope profile(OpClass::Gemm, "fp8_linear_backward_input");
  expect_cpu(dx, "fp8_linear_backward_input dx");
  expect_cpu(dy, "fp8_linear_backward_input dy");
  host_gemm(dx, quantize_host(dy, fp8.grad_format, fp8, Fp8Role::Dy), false, weight_host(w, fp8, gathered), false,
            beta);
}

}  // namespace

void fp8_linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, const Fp8Linear& fp8,
                               const Fp8GatheredWeight* gathered) {
  backward_input(dx, dy, w, fp8, gathered, 0.0f);
}

void fp8_linear_backward_input_add(const Tensor& dx, const Tensor& dy, const Tensor& w, const Fp8Linear& fp8,
                                   const Fp8GatheredWeight* gathered) {
  backward_input(dx, dy, w, fp8, gathered, 1.0f);
}

void fp8_linear_backward(const Tensor& dx, const Tensor& grad, const Tensor& dy, const Tensor& w, const Tensor& x,
                         const Fp8Linear& fp8, bool overwrite, const Fp8GatheredWeight* gathered) {
  // The reference quantizes dy twice, to the same codes. CUDA casts dy once, writing its
  // codes and their transpose, also for tokens the weight gradient pads (NOTE [FP8 padded
  // token contraction]: dy^T and x^T are padded after the input gradient's GEMM has read
  // the buffers they are padded into; a routed expert's rows are any number).
  if (dy.device() != Device::CUDA || dy.ndim() != 2 || !fp8.weight_gradient) {
    fp8_linear_backward_input(dx, dy, w, fp8, gathered);
    fp8_linear_backward_weight(grad, dy, x, fp8, overwrite);
    return;
  }
  check_matrices(dx, dy, w, "fp8_linear_backward");
  check_matrices(grad, dy, x, "fp8_linear_backward");
  const int64_t t = dy.dim(0), out = dy.dim(1), in = w.dim(1);
  FORGE_CHECK(w.dim(0) == out && x.dim(0) == t && x.dim(1) == in,
              "fp8_linear_backward: dy {}, W {} and x {} disagree", shape_str(dy.shape()), shape_str(w.shape()),
              shape_str(x.shape()));
  check_shape(dx, {t, in}, "fp8_linear_backward dx");
  check_shape(grad, {out, in}, "fp8_linear_backward dW");
  FORGE_CUDA_CALL("fp8_linear_backward", [&] {
    for (const Tensor* p : {&dx, &dy, &x}) expect_tensor(*p, Device::CUDA, DType::BF16, "fp8_linear_backward");
    if (!gathered) expect_tensor(w, Device::CUDA, DType::BF16, "fp8_linear_backward W");
    expect_tensor(grad, Device::CUDA, DType::F32, "fp8_linear_backward dW");
    const char* op = "fp8_linear_backward";
    const Fp8LinearWorkspace& ws = workspace_of(fp8, op);
    const int64_t padded = (t + kFp8TokenMultiple - 1) / kFp8TokenMultiple * kFp8TokenMultiple;
    // Buffer 2 holds dy^T [out, t] and later, when padding, x^T [in, t] before its copy.
    DeviceOperand d = operand(ws, 0, padded * out, op),
                  d_t = operand(ws, 2, t * (padded == t ? out : std::max(out, in)), op);
    DeviceOperand b = operand(ws, 1, std::max(out, padded) * in, op);
    {
      OpProfileScope profile(OpClass::Elementwise, "fp8_quantize");
      if (fp8_uses_delayed_scales(fp8)) {
        d = delayed_operand(fp8, Fp8Role::Dy, d.codes);
        cast_delayed(dy, fp8.grad_format, d, false, d_t.codes);
      } else if (float* at = prepared_output_gradient_stats(fp8, dy)) {  // already folded into seen
        d = {d.codes, at, at + kFp8StatStride, at + 2 * kFp8StatStride};
        cuda::fp8_cast_transpose(bf16_ptr(dy), t, out, d.scale, fp8.grad_format, d.codes, d_t.codes, nullptr);
      } else {
        if (!produced_output_gradient(fp8, dy)) cuda::fp8_amax(bf16_ptr(dy), dy.numel(), d.amax);
        agree_amax(fp8_amax_group_of(fp8, Fp8Role::Dy), d.amax, fp8_seen_of(fp8, Fp8Role::Dy));
        cuda::fp8_scale_from_amax(d.amax, fp8.grad_format, false, d.scale, d.scale_inv, fp8_seen_of(fp8, Fp8Role::Dy));
        cuda::fp8_cast_transpose(bf16_ptr(dy), t, out, d.scale, fp8.grad_format, d.codes, d_t.codes, nullptr);
      }
      d_t = {d_t.codes, d.amax, d.scale, d.scale_inv};  // dy^T: dy's statistics
      if (gathered) transpose_gathered(w, *gathered, fp8, b);
      else quantize_weight_transposed(w, fp8, b);  // W^T [in, out]
    }
    profiled_gemm("backward_input", t, in, out, [&] {
      cuda::fp8_matmul(dx.raw(), DType::BF16, gemm_operand(d, fp8.grad_format), gemm_operand(b, kE4M3), t, in, out,
                       1.0f, 0.0f, false, varying(fp8, cuda::GemmVarying::M));
    });
    b = operand(ws, 1, std::max(out, padded) * in, op);
    {
      OpProfileScope profile(OpClass::Elementwise, "fp8_quantize");
      if (padded == t) {
        quantize_input_transposed(x, fp8, b);  // x^T [in, t]
      } else {
        // The input gradient's GEMM, ordered before these on the stream, has read buffers 0
        // and 1: dy^T goes into buffer 0 as [out, padded], x^T through buffer 2 into buffer
        // 1 as [in, padded], zero codes in the added columns (fp8_linear_backward_weight's
        // layout, the same codes).
        cuda::fp8_pad_columns(d_t.codes, out, t, padded, d.codes);
        d_t = {d.codes, d.amax, d.scale, d.scale_inv};
        uint8_t* staging = operand(ws, 2, t * in, op).codes;
        DeviceOperand staged = {staging, b.amax, b.scale, b.scale_inv};
        quantize_input_transposed(x, fp8, staged);
        cuda::fp8_pad_columns(staging, in, t, padded, b.codes);
        b = {b.codes, staged.amax, staged.scale, staged.scale_inv};
      }
    }
    profiled_gemm("backward_weight", out, in, padded, [&] {
      cuda::fp8_matmul(grad.raw(), DType::F32, gemm_operand(d_t, fp8.grad_format), gemm_operand(b, kE4M3), out, in,
                       padded, 1.0f, overwrite ? 0.0f : 1.0f, false, varying(fp8, cuda::GemmVarying::K));
    });
  }());
}

void fp8_linear_backward_weight(const Tensor& grad, const Tensor& dy, const Tensor& x, const Fp8Linear& fp8,
                                bool overwrite) {
  if (!fp8.weight_gradient) {  // NOTE [FP8 weight gradient switch]: the compute dtype's GEMM
    matmul(grad, dy, true, x, false, 1.0f, overwrite ? 0.0f : 1.0f);
    return;
  }
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
      const char* op = "fp8_linear_backward_weight";
      const Fp8LinearWorkspace& ws = workspace_of(fp8, op);
      // NOTE [FP8 padded token contraction]: t rounded up to a multiple of 16.
      const int64_t padded = (t + kFp8TokenMultiple - 1) / kFp8TokenMultiple * kFp8TokenMultiple;
      DeviceOperand a = operand(ws, 0, padded * out, op);
      DeviceOperand b = operand(ws, 1, padded * in, op);
      {
        OpProfileScope profile(OpClass::Elementwise, "fp8_quantize");
        if (padded == t) {
          quantize_output_gradient(dy, fp8, /*transpose=*/true, a);  // dy^T [out, t]
          quantize_input_transposed(x, fp8, b);                       // x^T [in, t]
        } else {
          // Each operand quantized with its own statistics into the third buffer, then
          // copied into its own with zero columns.
          uint8_t* staging = operand(ws, 2, t * std::max(out, in), op).codes;
          DeviceOperand staged = {staging, a.amax, a.scale, a.scale_inv};
          quantize_output_gradient(dy, fp8, /*transpose=*/true, staged);
          cuda::fp8_pad_columns(staging, out, t, padded, a.codes);
          a = {a.codes, staged.amax, staged.scale, staged.scale_inv};
          staged = {staging, b.amax, b.scale, b.scale_inv};
          quantize_input_transposed(x, fp8, staged);
          cuda::fp8_pad_columns(staging, in, t, padded, b.codes);
          b = {b.codes, staged.amax, staged.scale, staged.scale_inv};
        }
      }
      profiled_gemm("backward_weight", out, in, padded, [&] {
        cuda::fp8_matmul(grad.raw(), DType::F32, gemm_operand(a, fp8.grad_format), gemm_operand(b, kE4M3), out, in,
                         padded, 1.0f, overwrite ? 0.0f : 1.0f, false, varying(fp8, cuda::GemmVarying::K));
      });
    }());
    return;
  }
  OpProfileScope profile(OpClass::Gemm, "fp8_linear_backward_weight");
  expect_cpu(grad, "fp8_linear_backward_weight dW");
  expect_cpu(dy, "fp8_linear_backward_weight dy");
  expect_cpu(x, "fp8_linear_backward_weight x");
  host_gemm(grad, quantize_host(dy, fp8.grad_format, fp8, Fp8Role::Dy), true, quantize_host(x, kE4M3, fp8, Fp8Role::X),
            false, overwrite ? 0.0f : 1.0f);
}

cuda::Fp8Epilogue fp8_input_epilogue(const Tensor& x, const Fp8Linear* consumer) {
#ifdef FORGE_CUDA
  if (!consumer || !consumer->produced || x.device() != Device::CUDA || x.ndim() != 2) return {};
  const Fp8Linear& fp8 = *consumer;
  Fp8Produced& p = *fp8.produced;
  if (fp8_uses_delayed_scales(fp8)) {
    const Tensor& codes = workspace_of(fp8, "fp8_input_epilogue").a_codes;
    if (codes.numel() < x.numel()) return {};
    const DeviceOperand d = delayed_operand(fp8, Fp8Role::X, codes.data<uint8_t>());
    p.x = x.raw();
    p.x_numel = x.numel();
    p.x_codes = true;
    p.x_codes_at = nullptr;
    return {d.amax, d.scale, d.codes};  // the role's seen, scale and the forward's code buffer
  }
  if (!fp8.forward || !fp8.forward->device) return {};
  float* amax = fp8.forward->device;  // x's slot of the forward statistics
  cuda::fp8_amax_reset(amax);
  p.x = x.raw();
  p.x_numel = x.numel();
  p.x_codes = false;
  return {amax, nullptr, nullptr};
#else
  (void)x;
  (void)consumer;
  return {};
#endif
}

float* fp8_output_gradient_amax(const Tensor& dy, const Fp8Linear* consumer) {
#ifdef FORGE_CUDA
  if (!consumer || !consumer->produced || dy.device() != Device::CUDA || fp8_uses_delayed_scales(*consumer)) return nullptr;
  // Operand 0's amax: where the backward quantizes dy (fp8_linear_backward, quantize_output_gradient).
  const char* op = "fp8_output_gradient_amax";
  float* amax = operand(workspace_of(*consumer, op), 0, 0, op).amax;
  cuda::fp8_amax_reset(amax);
  consumer->produced->dy = dy.raw();
  consumer->produced->dy_numel = dy.numel();
  return amax;
#else
  (void)dy;
  (void)consumer;
  return nullptr;
#endif
}

}  // namespace forge
