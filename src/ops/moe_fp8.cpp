#include "ops/moe_fp8.h"

#include <algorithm>

#include "ops/lora_experts.h"
#include "ops/swiglu.h"
#ifdef FORGE_CUDA
#include "core/device.h"
#include "kernels/cuda/fp8_grouped_cast.h"
#include "ops/placement.h"
#endif

namespace forge {
namespace {

// The stack's per-expert state when it holds the routing's experts (NOTE [FP8 expert stack
// state]), else null.
Fp8ExpertStack* expert_state(const Fp8Linear& stack, int64_t experts) {
  return stack.experts && stack.experts->experts() >= experts ? stack.experts : nullptr;
}

#ifdef FORGE_CUDA
// NOTE [FP8 grouped expert casts]: whether the forward's x of this stack can be quantized
// for all experts at once (CUDA, the per-expert state with its forward statistics, a
// buffer for the rows' codes, and no tensor-parallel amax reduction of x).
bool grouped_ok(const Tensor& x, const Fp8Linear& stack, const MoeRouting& r) {
  const Fp8ExpertStack* s = expert_state(stack, r.experts);
  return x.device() == Device::CUDA && s && s->grouped && s->row_codes && s->row_codes->defined() &&
         s->forward_stats.defined() && x.dim(1) % kFp8TokenMultiple == 0 &&
         s->row_codes->numel() >= cuda::fp8_grouped_codes_bytes(r.offsets.back(), x.dim(1), r.experts) &&
         (stack.amax_group_roles & fp8_role_bit(cpu::Fp8Role::X)) == 0;
}

// Every expert's rows of x [rows, in] quantized at once into the shared row codes, each
// expert's forward then handed its codes (NOTE [FP8 fused producers]): with `delayed`
// scales its block's scale, folding its rows' amax into its `seen`; else each expert's
// amax, scale and inverse into its forward statistics, its amax folded into its `seen`.
void quantize_rows_grouped(const Tensor& x, const Fp8Linear& stack, const MoeRouting& r, int64_t first_expert,
                           const int64_t* device_offsets) {
  Fp8ExpertStack& s = *stack.experts;
  const int64_t cols = x.dim(1);
  int64_t most = 0;
  for (int64_t e = 0; e < r.experts; ++e) most = std::max(most, r.rows(e));
  const cuda::Fp8RowGroups groups{device_offsets, r.experts, cols, most, 0};
  uint8_t* codes = s.row_codes->data<uint8_t>();
  float* seen_x = stack.stats + first_expert * cpu::kFp8ProjectionStats + cpu::fp8_seen_offset(0, cpu::Fp8Role::X);
  const cuda::Fp8GroupStats seen{seen_x, cpu::kFp8ProjectionStats};
  if (stack.delayed) {  // NOTE [FP8 delayed scaling]: the block's seen, then scale, kFp8StatStride apart
    cuda::fp8_grouped_cast(bf16_ptr(x), groups, {seen_x + kFp8StatStride, cpu::kFp8ProjectionStats},
                           Fp8Format::E4M3, codes, seen);
  } else {  // x's slots of each expert's forward statistics: amax, scale, inverse scale
    float* slots = s.forward_stats.data<float>();
    const cuda::Fp8GroupStats amax{slots, kFp8WorkspaceStats};
    cuda::fp8_grouped_amax(bf16_ptr(x), groups, amax);
    cuda::fp8_grouped_scale_from_amax(groups, amax, Fp8Format::E4M3, {slots + kFp8StatStride, kFp8WorkspaceStats},
                                      {slots + 2 * kFp8StatStride, kFp8WorkspaceStats}, seen);
    cuda::fp8_grouped_cast(bf16_ptr(x), groups, {slots + kFp8StatStride, kFp8WorkspaceStats}, Fp8Format::E4M3, codes,
                           {});
  }
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
    if (b == end) continue;
    const Tensor rows = x.narrow(b, end);
    s.produced[static_cast<size_t>(e)] = {rows.raw(), rows.numel(), true, nullptr, 0,
                                          codes + cuda::fp8_grouped_codes_at(b, cols, e)};
  }
}

// NOTE [FP8 grouped expert casts], the backward: whether every expert's output gradient
// dy [rows, out] can take its tensorwise statistics from one grouped amax and one grouped
// scale launch (CUDA, the per-expert state, current scaling, no tensor-parallel amax
// reduction of dy).
bool grouped_dy_ok(const Tensor& dy, const Fp8Linear& stack, const MoeRouting& r) {
  const Fp8ExpertStack* s = expert_state(stack, r.experts);
  return dy.device() == Device::CUDA && s && s->grouped && !stack.delayed && s->backward_stats.defined() &&
         dy.dim(1) % kFp8TokenMultiple == 0 && (stack.amax_group_roles & fp8_role_bit(cpu::Fp8Role::Dy)) == 0;
}

// Each expert's dy amax, scale and inverse scale (the grad format's), folded into its
// block's dy `seen`, then handed to its fp8_linear_backward through its Fp8Produced: the
// values the expert-by-expert amax and scale give, bitwise.
void prepare_output_gradients_grouped(const Tensor& dy, const Fp8Linear& stack, const MoeRouting& r,
                                      int64_t first_expert, const int64_t* device_offsets) {
  Fp8ExpertStack& s = *stack.experts;
  int64_t most = 0;
  for (int64_t e = 0; e < r.experts; ++e) most = std::max(most, r.rows(e));
  const cuda::Fp8RowGroups groups{device_offsets, r.experts, dy.dim(1), most, 0};
  constexpr int64_t kSlots = 3 * kFp8StatStride;
  float* slots = s.backward_stats.data<float>();
  float* seen_dy = stack.stats + first_expert * cpu::kFp8ProjectionStats + cpu::fp8_seen_offset(0, cpu::Fp8Role::Dy);
  const cuda::Fp8GroupStats amax{slots, kSlots};
  cuda::fp8_grouped_amax(bf16_ptr(dy), groups, amax);
  cuda::fp8_grouped_scale_from_amax(groups, amax, stack.grad_format, {slots + kFp8StatStride, kSlots},
                                    {slots + 2 * kFp8StatStride, kSlots}, {seen_dy, cpu::kFp8ProjectionStats});
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
    if (b == end) continue;
    const Tensor rows = dy.narrow(b, end);
    Fp8Produced& p = s.produced[static_cast<size_t>(e)];
    p.dy = rows.raw();
    p.dy_numel = rows.numel();
    p.dy_stats_at = slots + e * kSlots;
  }
}

// The routing's offsets on the device, in the state's own buffer (one small asynchronous
// copy per forward; the routing's device offsets are not always these, e.g. under expert
// parallelism or padded to capacity).
const int64_t* upload_offsets(Fp8ExpertStack& s, const MoeRouting& r) {
  const int64_t n = r.experts + 1;
  if (!s.offsets.defined() || s.offsets.numel() < n) s.offsets = Tensor::empty({n}, DType::I64, Device::CUDA);
  copy_bytes_on(s.offsets.raw(), Device::CUDA, r.offsets.data(), Device::CPU, static_cast<size_t>(n) * sizeof(int64_t),
                nullptr);
  return s.offsets.data<int64_t>();
}
#endif

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

void init_fp8_expert_stack(Fp8ExpertStack& stack, int64_t experts, int64_t out, int64_t in, Device device,
                           bool weight_cache, const uint64_t* generation, Tensor* row_codes) {
  FORGE_CHECK(experts >= 0 && out > 0 && in > 0, "FP8 expert stack: {} experts of [{}, {}]", experts, out, in);
  const auto n = static_cast<size_t>(experts);
  stack.forward.assign(n, {});
  stack.produced.assign(n, {});
  stack.caches.clear();
  stack.row_codes = row_codes;
  if (device != Device::CUDA) return;  // the CPU reference keeps none of it
  stack.forward_stats = Tensor::zeros({std::max<int64_t>(experts, 1) * kFp8WorkspaceStats}, DType::F32, device);
  stack.backward_stats = Tensor::zeros({std::max<int64_t>(experts, 1) * 3 * kFp8StatStride}, DType::F32, device);
  for (size_t e = 0; e < n; ++e)
    stack.forward[e].device = stack.forward_stats.data<float>() + static_cast<int64_t>(e) * kFp8WorkspaceStats;
  if (!weight_cache) return;
  FORGE_CHECK(generation, "FP8 expert stack: a weight cache needs the step clock");
  stack.caches.resize(n);
  for (Fp8WeightCache& c : stack.caches) {
    c.codes = Tensor::empty({out * in}, DType::U8, device);
    c.codes_t = Tensor::empty({out * in}, DType::U8, device);
    c.generation = generation;
  }
}

Fp8Linear fp8_expert_linear(const Fp8Linear& stack, int64_t expert, int64_t local) {
  FORGE_CHECK(stack.stats, "FP8 expert {}: the stack's settings have no statistics blocks", expert);
  Fp8Linear e = stack;
  e.stats = stack.stats + expert * cpu::kFp8ProjectionStats;
  e.forward = nullptr;
  e.weight_cache = nullptr;
  e.produced = nullptr;
  e.experts = nullptr;
  e.varying_tokens = true;  // the rows the routing gave it (NOTE [FP8 GEMMs of varying size])
  if (Fp8ExpertStack* s = stack.experts; s && local >= 0) {  // NOTE [FP8 expert stack state]
    FORGE_CHECK(local < s->experts(), "FP8 expert {}: local expert {} of a stack state of {}", expert, local,
                s->experts());
    const auto i = static_cast<size_t>(local);
    if (s->forward[i].device) e.forward = &s->forward[i];
    e.produced = &s->produced[i];
    if (s->cache_in_use && i < s->caches.size()) e.weight_cache = &s->caches[i];
  }
  return e;
}

void moe_experts_forward_fp8(const MoeExpertBuffers& a, const MoeExpertWeights& w, const MoeRouting& r,
                             const MoeExpertFp8& fp8) {
  check_fp8_experts(w, r, a, fp8, "moe_experts_forward_fp8");
#ifdef FORGE_CUDA
  const int64_t* device_offsets = nullptr;
#endif
  auto per_expert = [&](const Tensor& y, const Tensor& x, const Tensor& weight, const Fp8Linear& stack,
                        const Fp8GatheredWeight* gathered) {
    const bool stateful = expert_state(stack, r.experts) != nullptr;
#ifdef FORGE_CUDA
    if (x.dim(0) > 0 && grouped_ok(x, stack, r)) {  // NOTE [FP8 grouped expert casts]
      if (!device_offsets) device_offsets = upload_offsets(*stack.experts, r);
      quantize_rows_grouped(x, stack, r, fp8.first_expert, device_offsets);
    }
#endif
    for (int64_t e = 0; e < r.experts; ++e) {
      const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
      if (b != end)
        fp8_linear_forward(y.narrow(b, end), x.narrow(b, end), moe_expert_matrix(weight, e),
                           fp8_expert_linear(stack, fp8.first_expert + e, stateful ? e : -1), nullptr,
                           gathered ? gathered + e : nullptr);
    }
  };
  // NOTE [FP8 frozen routed experts]: the adapters' share added in the compute dtype.
  per_expert(a.gate_up, a.permuted, w.gate_up, *fp8.gate_up, fp8.gate_up_gathered);
  if (w.gate_up_lora) lora_experts_forward_add(a.gate_up, a.permuted, *w.gate_up_lora, r);
  if (a.gate_up.dim(0) > 0) swiglu_forward(a.swiglu, a.gate_up);  // every row at once, in the compute dtype
  per_expert(a.expert_out, a.swiglu, w.down, *fp8.down, fp8.down_gathered);
  if (w.down_lora) lora_experts_forward_add(a.expert_out, a.swiglu, *w.down_lora, r);
}

void moe_experts_backward_fp8(const Tensor& d_permuted, const MoeExpertWeights& grads, bool overwrite,
                              const Tensor& d_expert_out, const MoeExpertBuffers& a, const MoeExpertWeights& w,
                              const MoeRouting& r, const Tensor& d_swiglu, const Tensor& d_gate_up,
                              const MoeExpertFp8& fp8) {
  const char* op = "moe_experts_backward_fp8";
  check_fp8_experts(w, r, a, fp8, op);
  // Frozen experts (LoRA's base, NOTE [FP8 frozen routed experts]) have both gradient
  // tensors undefined: dx alone.
  const bool frozen = !grads.gate_up.defined() && !grads.down.defined();
  FORGE_CHECK(frozen || (grads.gate_up.defined() && grads.down.defined()),
              "{}: both expert stacks need gradients, or neither (frozen)", op);
  FORGE_CHECK(frozen || (grads.gate_up.shape() == w.gate_up.shape() && grads.down.shape() == w.down.shape()),
              "{}: gradients {} and {} for weights {} and {}", op, shape_str(grads.gate_up.shape()),
              shape_str(grads.down.shape()), shape_str(w.gate_up.shape()), shape_str(w.down.shape()));
  // dx_e = dy_e W_e and dW_e (+)= dy_e^T x_e on each expert's rows; no rows: a zero gradient
  // when written over, nothing to add otherwise.
#ifdef FORGE_CUDA
  const int64_t* device_offsets = nullptr;
#endif
  auto per_expert = [&](const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Fp8Linear& stack, const Fp8GatheredWeight* gathered) {
    const bool stateful = expert_state(stack, r.experts) != nullptr;
#ifdef FORGE_CUDA
    // NOTE [FP8 grouped expert casts]: dy's statistics for fp8_linear_backward's one cast;
    // not with the weight gradients in the compute dtype (NOTE [FP8 weight gradient switch]
    // in ops/fp8_linear.h), whose input-gradient casts take their own.
    if (!frozen && stack.weight_gradient && dy.dim(0) > 0 && grouped_dy_ok(dy, stack, r)) {
      if (!device_offsets) device_offsets = upload_offsets(*stack.experts, r);
      prepare_output_gradients_grouped(dy, stack, r, fp8.first_expert, device_offsets);
    }
#endif
    for (int64_t e = 0; e < r.experts; ++e) {
      const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
      if (b == end) {
        if (overwrite && !frozen) moe_expert_matrix(dw, e).fill_zero();
        continue;
      }
      const Fp8Linear expert = fp8_expert_linear(stack, fp8.first_expert + e, stateful ? e : -1);
      if (frozen) {
        fp8_linear_backward_input(dx.narrow(b, end), dy.narrow(b, end), moe_expert_matrix(weight, e), expert,
                                  gathered ? gathered + e : nullptr);
      } else {  // both GEMMs in one call: dy_e cast once, its codes and their transpose together
        fp8_linear_backward(dx.narrow(b, end), moe_expert_matrix(dw, e), dy.narrow(b, end),
                            moe_expert_matrix(weight, e), x.narrow(b, end), expert, overwrite,
                            gathered ? gathered + e : nullptr);
      }
    }
  };
  // The adapters' input gradients added to dx and their own gradients, in the compute dtype
  // from the unquantized dy and x (NOTE [FP8 frozen routed experts]).
  per_expert(d_swiglu, grads.down, d_expert_out, a.swiglu, w.down, *fp8.down, fp8.down_gathered);
  lora_experts_backward(d_swiglu, d_expert_out, a.swiglu, w.down_lora, grads.down_lora, r, overwrite);
  if (a.gate_up.dim(0) > 0) swiglu_backward(d_gate_up, d_swiglu, a.gate_up);
  per_expert(d_permuted, grads.gate_up, d_gate_up, a.permuted, w.gate_up, *fp8.gate_up, fp8.gate_up_gathered);
  lora_experts_backward(d_permuted, d_gate_up, a.permuted, w.gate_up_lora, grads.gate_up_lora, r, overwrite);
}

}  // namespace forge
