// NOTE [LoRA on routed experts] in ops/lora_experts.h.
#include "ops/lora_experts.h"

#include "core/error.h"
#include "ops/matmul.h"

namespace forge {
namespace {

void check(const LoraExpertAdapter& lora, const Tensor& x, const Tensor& y, const MoeRouting& r, const char* op) {
  FORGE_CHECK(lora.workspace && lora.rank > 0 && lora.experts == r.experts, "{}: expert LoRA of {} experts, rank {}"
              ", for a routing of {} experts", op, lora.experts, lora.rank, r.experts);
  check_shape(lora.a, {lora.experts * lora.rank, x.dim(1)}, "expert LoRA a");
  check_shape(lora.b, {lora.experts * y.dim(1), lora.rank}, "expert LoRA b");
  FORGE_CHECK(x.dim(0) == y.dim(0) && static_cast<int64_t>(r.offsets.size()) == r.experts + 1 &&
                  r.offsets.back() <= x.dim(0),
              "{}: rows {} and {} for expert offsets up to {}", op, x.dim(0), y.dim(0),
              r.offsets.empty() ? 0 : r.offsets.back());
}

// [rows, rank] at the start of a flat workspace buffer.
Tensor scratch(const Tensor& flat, int64_t rows, int64_t rank, const char* what) {
  FORGE_CHECK(flat.defined() && flat.numel() >= rows * rank, "expert LoRA workspace '{}' holds {} values, {} x {} "
              "are needed", what, flat.defined() ? flat.numel() : 0, rows, rank);
  return flat.narrow(0, rows * rank).view({rows, rank});
}

Tensor a_of(const Tensor& a, const LoraExpertAdapter& lora, int64_t e) {
  return a.narrow(e * lora.rank, (e + 1) * lora.rank);
}
Tensor b_of(const Tensor& b, const LoraExpertAdapter& lora, int64_t e) {
  const int64_t out = b.dim(0) / lora.experts;
  return b.narrow(e * out, (e + 1) * out);
}

}  // namespace

void lora_experts_forward_add(const Tensor& y, const Tensor& x, const LoraExpertAdapter& lora, const MoeRouting& r) {
  check(lora, x, y, r, "lora_experts_forward_add");
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t begin = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
    if (begin == end) continue;
    const Tensor u = scratch(lora.workspace->low_rank, end - begin, lora.rank, "low_rank");
    matmul_varying(GemmVarying::M, u, x.narrow(begin, end), false, a_of(lora.a, lora, e), true);
    matmul_varying(GemmVarying::M, y.narrow(begin, end), u, false, b_of(lora.b, lora, e), true, lora.scale, 1.0f);
  }
}

void lora_experts_backward_input_add(const Tensor& dx, const Tensor& dy, const LoraExpertAdapter& lora,
                                     const MoeRouting& r) {
  check(lora, dx, dy, r, "lora_experts_backward_input_add");
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t begin = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
    if (begin == end) continue;
    const Tensor g = scratch(lora.workspace->low_rank_grad, end - begin, lora.rank, "low_rank_grad");
    matmul_varying(GemmVarying::M, g, dy.narrow(begin, end), false, b_of(lora.b, lora, e), false);
    matmul_varying(GemmVarying::M, dx.narrow(begin, end), g, false, a_of(lora.a, lora, e), false, lora.scale, 1.0f);
  }
}

void lora_experts_backward_weight(const LoraExpertAdapter& lora, const Tensor& dy, const Tensor& x,
                                  const MoeRouting& r, bool overwrite) {
  check(lora, x, dy, r, "lora_experts_backward_weight");
  FORGE_CHECK(lora.grad_a.defined() && lora.grad_b.defined(), "expert LoRA gradient descriptor without buffers");
  check_shape(lora.grad_a, lora.a.shape(), "expert LoRA grad_a");
  check_shape(lora.grad_b, lora.b.shape(), "expert LoRA grad_b");
  const float beta = overwrite ? 0.0f : 1.0f;
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t begin = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
    const Tensor da = a_of(lora.grad_a, lora, e), db = b_of(lora.grad_b, lora, e);
    if (begin == end) {  // no rows: a zero gradient when written over, nothing to add otherwise
      if (overwrite) {
        da.fill_zero();
        db.fill_zero();
      }
      continue;
    }
    const Tensor x_e = x.narrow(begin, end), dy_e = dy.narrow(begin, end);
    const Tensor u = scratch(lora.workspace->low_rank, end - begin, lora.rank, "low_rank");
    const Tensor g = scratch(lora.workspace->low_rank_grad, end - begin, lora.rank, "low_rank_grad");
    matmul_varying(GemmVarying::M, u, x_e, false, a_of(lora.a, lora, e), true);
    matmul_varying(GemmVarying::M, g, dy_e, false, b_of(lora.b, lora, e), false);
    matmul_varying(GemmVarying::K, da, g, true, x_e, false, lora.scale, beta);
    matmul_varying(GemmVarying::K, db, dy_e, true, u, false, lora.scale, beta);
  }
}

void lora_experts_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const LoraExpertAdapter* weights,
                           const LoraExpertAdapter* grads, const MoeRouting& routing, bool overwrite) {
  if (grads && grads->grad_a.defined()) lora_experts_backward_weight(*grads, dy, x, routing, overwrite);
  if (weights) lora_experts_backward_input_add(dx, dy, *weights, routing);
}

}  // namespace forge
