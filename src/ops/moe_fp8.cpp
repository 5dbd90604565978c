#include "ops/moe_fp8.h"

#include "ops/swiglu.h"

namespace forge {
namespace {

void check_fp8_experts(const MoeExpertWeights& w, const MoeRouting& r, const MoeExpertBuffers& a,
                       const MoeExpertFp8& fp8, const char* op) {
  FORGE_CHECK(fp8.enabled(), "{}: both expert stacks need FP8 settings", op);
  FORGE_CHECK(fp8.gate_up->stats && fp8.down->stats,
              "{}: the expert stacks' FP8 settings need their statistics blocks (one per expert)", op);
  FORGE_CHECK(r.experts >= 0 && r.offsets.size() == static_cast<size_t>(r.experts + 1) && r.offsets.front() == 0 &&
                  r.offsets.back() <= a.permuted.dim(0),
              "{}: {} expert offsets ending at {} for buffers of {} rows", op, r.offsets.size(),
              r.offsets.empty() ? 0 : r.offsets.back(), a.permuted.dim(0));
  const int64_t hidden = a.permuted.dim(1);
  FORGE_CHECK(w.gate_up.ndim() == 3 && w.down.ndim() == 3 && w.gate_up.dim(0) == r.experts &&
                  w.down.dim(0) == r.experts && w.gate_up.dim(2) == hidden && w.down.dim(1) == hidden &&
                  w.gate_up.dim(1) == 2 * w.down.dim(2),
              "{}: expert weights gate_up {} and down {} must be [{}, 2F, {}] and [{}, {}, F]", op,
              shape_str(w.gate_up.shape()), shape_str(w.down.shape()), r.experts, hidden, r.experts, hidden);
}

}  // namespace

Fp8Linear fp8_expert_linear(const Fp8Linear& stack, int64_t expert) {
  FORGE_CHECK(stack.stats, "FP8 expert {}: the stack's settings have no statistics blocks", expert);
  Fp8Linear e = stack;
  e.stats = stack.stats + expert * cpu::kFp8ProjectionStats;
  e.forward = nullptr;
  e.weight_cache = nullptr;
  e.produced = nullptr;
  e.varying_tokens = true;  // the rows the routing gave it (NOTE [FP8 GEMMs of varying size])
  return e;
}

void moe_experts_forward_fp8(const MoeExpertBuffers& a, const MoeExpertWeights& w, const MoeRouting& r,
                             const MoeExpertFp8& fp8) {
  check_fp8_experts(w, r, a, fp8, "moe_experts_forward_fp8");
  auto per_expert = [&](const Tensor& y, const Tensor& x, const Tensor& weight, const Fp8Linear& stack) {
    for (int64_t e = 0; e < r.experts; ++e) {
      const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
      if (b != end)
        fp8_linear_forward(y.narrow(b, end), x.narrow(b, end), moe_expert_matrix(weight, e),
                           fp8_expert_linear(stack, fp8.first_expert + e), nullptr);
    }
  };
  per_expert(a.gate_up, a.permuted, w.gate_up, *fp8.gate_up);
  if (a.gate_up.dim(0) > 0) swiglu_forward(a.swiglu, a.gate_up);  // every row at once, in the compute dtype
  per_expert(a.expert_out, a.swiglu, w.down, *fp8.down);
}

void moe_experts_backward_fp8(const Tensor& d_permuted, const MoeExpertWeights& grads, bool overwrite,
                              const Tensor& d_expert_out, const MoeExpertBuffers& a, const MoeExpertWeights& w,
                              const MoeRouting& r, const Tensor& d_swiglu, const Tensor& d_gate_up,
                              const MoeExpertFp8& fp8) {
  const char* op = "moe_experts_backward_fp8";
  check_fp8_experts(w, r, a, fp8, op);
  FORGE_CHECK(grads.gate_up.defined() && grads.down.defined(),
              "{}: frozen experts (no gradients) do not run in FP8", op);
  FORGE_CHECK(grads.gate_up.shape() == w.gate_up.shape() && grads.down.shape() == w.down.shape(),
              "{}: gradients {} and {} for weights {} and {}", op, shape_str(grads.gate_up.shape()),
              shape_str(grads.down.shape()), shape_str(w.gate_up.shape()), shape_str(w.down.shape()));
  // dx_e = dy_e W_e and dW_e (+)= dy_e^T x_e on each expert's rows; no rows: a zero gradient
  // when written over, nothing to add otherwise.
  auto per_expert = [&](const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Fp8Linear& stack) {
    for (int64_t e = 0; e < r.experts; ++e) {
      const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
      if (b == end) {
        if (overwrite) moe_expert_matrix(dw, e).fill_zero();
        continue;
      }
      const Fp8Linear expert = fp8_expert_linear(stack, fp8.first_expert + e);
      const Tensor dy_e = dy.narrow(b, end);
      fp8_linear_backward_input(dx.narrow(b, end), dy_e, moe_expert_matrix(weight, e), expert);
      fp8_linear_backward_weight(moe_expert_matrix(dw, e), dy_e, x.narrow(b, end), expert, overwrite);
    }
  };
  per_expert(d_swiglu, grads.down, d_expert_out, a.swiglu, w.down, *fp8.down);
  if (a.gate_up.dim(0) > 0) swiglu_backward(d_gate_up, d_swiglu, a.gate_up);
  per_expert(d_permuted, grads.gate_up, d_gate_up, a.permuted, w.gate_up, *fp8.gate_up);
}

}  // namespace forge
