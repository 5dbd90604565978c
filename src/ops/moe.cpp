#include "ops/moe.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "core/op_profile.h"
#include "kernels/cpu/moe.h"
#include "ops/linear.h"
#include "ops/placement.h"
#include "ops/swiglu.h"

namespace forge {
namespace {

// NOTE [MoE routing]: the CPU reference only, so far.
void expect_cpu(const Tensor& t, DType dtype, const char* what) {
  FORGE_CHECK(t.device() == Device::CPU, "{}: the MoE ops run on the CPU only (their CUDA kernels are not built yet)",
              what);
  expect_tensor(t, Device::CPU, dtype, what);
}

// Expert e's [2F, H] or [H, F] matrix of a stacked [E, ., .] tensor.
Tensor expert_matrix(const Tensor& stacked, int64_t e) {
  return stacked.narrow(e, e + 1).view({stacked.dim(1), stacked.dim(2)});
}

void check_experts(const MoeExpertWeights& w, const MoeRouting& r, int64_t hidden, const char* op) {
  FORGE_CHECK(w.gate_up.ndim() == 3 && w.down.ndim() == 3 && w.gate_up.dim(0) == r.experts &&
                  w.down.dim(0) == r.experts && w.gate_up.dim(2) == hidden && w.down.dim(1) == hidden &&
                  w.gate_up.dim(1) == 2 * w.down.dim(2),
              "{}: expert weights gate_up {} and down {} must be [{}, 2F, {}] and [{}, {}, F]", op,
              shape_str(w.gate_up.shape()), shape_str(w.down.shape()), r.experts, hidden, r.experts, hidden);
}

void check_routing(const MoeRouting& r, const char* op) {
  FORGE_CHECK(r.offsets.size() == static_cast<size_t>(r.experts + 1) && r.source.numel() == r.tokens * r.k,
              "{}: the routing is not from moe_route", op);
}

// The routing's sort by expert, from its expert_ids.
void sort_by_expert(MoeRouting& r) {
  r.offsets.assign(static_cast<size_t>(r.experts + 1), 0);
  r.source = Tensor::empty({r.tokens * r.k}, DType::I32);
  r.row_of = Tensor::empty({r.tokens * r.k}, DType::I32);
  cpu::moe_sort_by_expert(r.expert_ids.data<int32_t>(), r.tokens, r.k, r.experts, r.offsets.data(),
                          r.source.data<int32_t>(), r.row_of.data<int32_t>());
}

// The hidden width shared by a token tensor [tokens, hidden] and a row tensor [tokens * k,
// hidden] of the routing (permuted order), both fp32 on the CPU; refused otherwise, naming each.
int64_t token_and_row_width(const MoeRouting& r, const char* op, const Tensor& by_token, const char* token_name,
                            const Tensor& by_row, const char* row_name) {
  check_routing(r, op);
  FORGE_CHECK(by_token.ndim() == 2 && by_token.dim(0) == r.tokens, "{}: {} {} must be [{}, hidden]", op, token_name,
              shape_str(by_token.shape()), r.tokens);
  const int64_t hidden = by_token.dim(1);
  check_shape(by_row, {r.tokens * r.k, hidden}, fmt::format("{} {}", op, row_name).c_str());
  expect_cpu(by_token, DType::F32, fmt::format("{} {}", op, token_name).c_str());
  expect_cpu(by_row, DType::F32, fmt::format("{} {}", op, row_name).c_str());
  return hidden;
}

// A routing of logits [tokens, experts] with its outputs allocated, before the router fills them.
MoeRouting new_routing(const Tensor& logits, int64_t k, bool normalize, const char* op) {
  FORGE_CHECK(logits.ndim() == 2, "{}: logits {} must be [tokens, experts]", op, shape_str(logits.shape()));
  expect_cpu(logits, DType::F32, op);
  MoeRouting r;
  r.tokens = logits.dim(0);
  r.experts = logits.dim(1);
  r.k = k;
  r.normalize = normalize;
  r.probs = Tensor::empty({r.tokens, r.experts});
  r.expert_ids = Tensor::empty({r.tokens, std::max<int64_t>(k, 0)}, DType::I32);
  r.weights = Tensor::empty({r.tokens, std::max<int64_t>(k, 0)});
  return r;
}

}  // namespace

MoeRouting moe_route(const Tensor& logits, int64_t k, bool normalize) {
  OpProfileScope profile(OpClass::Elementwise, "moe_route");
  MoeRouting r = new_routing(logits, k, normalize, "moe_route logits");
  FORGE_CHECK(k >= 1 && k <= r.experts, "moe_route: top-k {} must be between 1 and the {} experts", k, r.experts);
  cpu::moe_topk_softmax(logits.data<float>(), r.tokens, r.experts, k, normalize, r.probs.data<float>(),
                        r.expert_ids.data<int32_t>(), r.weights.data<float>());
  sort_by_expert(r);
  return r;
}

MoeRouting moe_route_sigmoid(const Tensor& logits, const Tensor& bias, int64_t k, int64_t groups, int64_t topk_groups,
                             bool normalize, float scaling) {
  OpProfileScope profile(OpClass::Elementwise, "moe_route");
  MoeRouting r = new_routing(logits, k, normalize, "moe_route_sigmoid logits");
  r.sigmoid = true;
  r.scaling = scaling;
  FORGE_CHECK(groups >= 1 && r.experts % groups == 0 && topk_groups >= 1 && topk_groups <= groups,
              "moe_route_sigmoid: {} experts in {} groups keeping {}: the groups must divide the experts and keep "
              "between 1 and all of them",
              r.experts, groups, topk_groups);
  FORGE_CHECK(k >= 1 && k <= topk_groups * (r.experts / groups),
              "moe_route_sigmoid: top-k {} must be between 1 and the {} experts of the {} groups kept", k,
              topk_groups * (r.experts / groups), topk_groups);
  if (bias.defined()) {
    check_shape(bias, {r.experts}, "moe_route_sigmoid bias");
    expect_cpu(bias, DType::F32, "moe_route_sigmoid bias");
  }
  cpu::moe_topk_sigmoid(logits.data<float>(), bias.defined() ? bias.data<float>() : nullptr, r.tokens, r.experts, k,
                        groups, topk_groups, normalize, scaling, r.probs.data<float>(), r.expert_ids.data<int32_t>(),
                        r.weights.data<float>());
  sort_by_expert(r);
  return r;
}

MoeBalance moe_balancing_loss(const std::vector<const MoeRouting*>& routings) {
  FORGE_CHECK(!routings.empty(), "moe_balancing_loss: no routing given");
  const int64_t experts = routings.front()->experts;
  std::vector<double> assigned(static_cast<size_t>(experts), 0.0), probs(static_cast<size_t>(experts), 0.0);
  double rows = 0.0;
  for (const MoeRouting* r : routings) {
    check_routing(*r, "moe_balancing_loss");
    FORGE_CHECK(!r->sigmoid, "moe_balancing_loss: the Switch/Mixtral balancing loss is for softmax routing");
    FORGE_CHECK(r->experts == experts, "moe_balancing_loss: routings over {} and {} experts", experts, r->experts);
    const float* p = r->probs.data<float>();
    for (int64_t e = 0; e < experts; ++e) {
      assigned[static_cast<size_t>(e)] += static_cast<double>(r->rows(e));
      for (int64_t t = 0; t < r->tokens; ++t) probs[static_cast<size_t>(e)] += p[t * experts + e];
    }
    rows += static_cast<double>(r->tokens);
  }
  MoeBalance b;
  b.prob_gradient.assign(static_cast<size_t>(experts), 0.0);
  if (rows == 0.0) return b;
  for (int64_t e = 0; e < experts; ++e) {
    const double f = assigned[static_cast<size_t>(e)] / rows;
    b.loss += static_cast<double>(experts) * f * probs[static_cast<size_t>(e)] / rows;
    b.prob_gradient[static_cast<size_t>(e)] = static_cast<double>(experts) * f / rows;
  }
  return b;
}

void moe_route_backward(const Tensor& d_logits, const Tensor& d_weights, const MoeRouting& r,
                        const std::vector<double>* prob_gradient) {
  OpProfileScope profile(OpClass::Elementwise, "moe_route_backward");
  check_routing(r, "moe_route_backward");
  check_shape(d_logits, {r.tokens, r.experts}, "moe_route_backward d_logits");
  check_shape(d_weights, {r.tokens, r.k}, "moe_route_backward d_weights");
  expect_cpu(d_logits, DType::F32, "moe_route_backward d_logits");
  expect_cpu(d_weights, DType::F32, "moe_route_backward d_weights");
  if (r.sigmoid) {
    FORGE_CHECK(!prob_gradient, "moe_route_backward: the Switch/Mixtral balancing loss is for softmax routing");
    cpu::moe_topk_sigmoid_backward(d_weights.data<float>(), r.probs.data<float>(), r.expert_ids.data<int32_t>(),
                                   r.tokens, r.experts, r.k, r.normalize, r.scaling, d_logits.data<float>());
    return;
  }
  Tensor d_probs;
  if (prob_gradient && r.tokens > 0) {
    FORGE_CHECK(prob_gradient->size() == static_cast<size_t>(r.experts),
                "moe_route_backward: a probability gradient for {} experts, the routing has {}", prob_gradient->size(),
                r.experts);
    d_probs = Tensor::empty({r.tokens, r.experts});
    for (int64_t t = 0; t < r.tokens; ++t)
      for (int64_t e = 0; e < r.experts; ++e)
        d_probs.data<float>()[t * r.experts + e] = static_cast<float>((*prob_gradient)[static_cast<size_t>(e)]);
  }
  cpu::moe_topk_softmax_backward(d_weights.data<float>(), d_probs.defined() ? d_probs.data<float>() : nullptr,
                                 r.probs.data<float>(), r.expert_ids.data<int32_t>(), r.weights.data<float>(), r.tokens,
                                 r.experts, r.k, r.normalize, d_logits.data<float>());
}

void moe_permute(const Tensor& permuted, const Tensor& x, const MoeRouting& r) {
  OpProfileScope profile(OpClass::Elementwise, "moe_permute");
  const int64_t hidden = token_and_row_width(r, "moe_permute", x, "x", permuted, "permuted");
  const int32_t* source = r.source.data<int32_t>();
  for (int64_t row = 0; row < r.tokens * r.k; ++row) {
    const float* from = x.data<float>() + source[row] / r.k * hidden;
    std::copy(from, from + hidden, permuted.data<float>() + row * hidden);
  }
}

void moe_permute_backward(const Tensor& dx, const Tensor& d_permuted, const MoeRouting& r) {
  OpProfileScope profile(OpClass::Elementwise, "moe_permute_backward");
  const int64_t hidden = token_and_row_width(r, "moe_permute_backward", dx, "dx", d_permuted, "d_permuted");
  const int32_t* row_of = r.row_of.data<int32_t>();
  for (int64_t t = 0; t < r.tokens; ++t) {
    float* to = dx.data<float>() + t * hidden;
    std::fill(to, to + hidden, 0.0f);
    for (int64_t j = 0; j < r.k; ++j) {
      const float* from = d_permuted.data<float>() + static_cast<int64_t>(row_of[t * r.k + j]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) to[h] += from[h];
    }
  }
}

void moe_combine(const Tensor& out, const Tensor& expert_out, const MoeRouting& r, const Tensor* residual) {
  OpProfileScope profile(OpClass::Elementwise, "moe_combine");
  const int64_t hidden = token_and_row_width(r, "moe_combine", out, "out", expert_out, "expert_out");
  if (residual) {
    check_shape(*residual, out.shape(), "moe_combine residual");
    expect_cpu(*residual, DType::F32, "moe_combine residual");
  }
  const int32_t* row_of = r.row_of.data<int32_t>();
  const float* w = r.weights.data<float>();
  std::vector<double> sum(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < r.tokens; ++t) {
    float* to = out.data<float>() + t * hidden;
    for (int64_t h = 0; h < hidden; ++h) sum[static_cast<size_t>(h)] = residual ? residual->data<float>()[t * hidden + h] : 0.0;
    for (int64_t j = 0; j < r.k; ++j) {
      const float* y = expert_out.data<float>() + static_cast<int64_t>(row_of[t * r.k + j]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) sum[static_cast<size_t>(h)] += static_cast<double>(w[t * r.k + j]) * y[h];
    }
    for (int64_t h = 0; h < hidden; ++h) to[h] = static_cast<float>(sum[static_cast<size_t>(h)]);
  }
}

void moe_combine_backward(const Tensor& d_expert_out, const Tensor& d_weights, const Tensor& dout,
                          const Tensor& expert_out, const MoeRouting& r) {
  OpProfileScope profile(OpClass::Elementwise, "moe_combine_backward");
  const int64_t hidden = token_and_row_width(r, "moe_combine_backward", dout, "dout", expert_out, "expert_out");
  check_shape(d_expert_out, {r.tokens * r.k, hidden}, "moe_combine_backward d_expert_out");
  check_shape(d_weights, {r.tokens, r.k}, "moe_combine_backward d_weights");
  expect_cpu(d_expert_out, DType::F32, "moe_combine_backward d_expert_out");
  expect_cpu(d_weights, DType::F32, "moe_combine_backward d_weights");
  const int32_t* row_of = r.row_of.data<int32_t>();
  const float* w = r.weights.data<float>();
  for (int64_t t = 0; t < r.tokens; ++t) {
    const float* g = dout.data<float>() + t * hidden;
    for (int64_t j = 0; j < r.k; ++j) {
      const int64_t row = row_of[t * r.k + j];
      const float* y = expert_out.data<float>() + row * hidden;
      float* dy = d_expert_out.data<float>() + row * hidden;
      double dot = 0.0;
      for (int64_t h = 0; h < hidden; ++h) {
        dy[h] = w[t * r.k + j] * g[h];
        dot += static_cast<double>(g[h]) * y[h];
      }
      d_weights.data<float>()[t * r.k + j] = static_cast<float>(dot);
    }
  }
}

void moe_experts_forward(const MoeExpertBuffers& a, const MoeExpertWeights& w, const MoeRouting& r) {
  check_routing(r, "moe_experts_forward");
  check_experts(w, r, a.permuted.dim(1), "moe_experts_forward");
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
    if (b == end) continue;
    linear_forward(a.gate_up.narrow(b, end), a.permuted.narrow(b, end), {expert_matrix(w.gate_up, e)});
    swiglu_forward(a.swiglu.narrow(b, end), a.gate_up.narrow(b, end));
    linear_forward(a.expert_out.narrow(b, end), a.swiglu.narrow(b, end), {expert_matrix(w.down, e)});
  }
}

void moe_experts_backward(const Tensor& d_permuted, const MoeExpertWeights& grads, bool overwrite,
                          const Tensor& d_expert_out, const MoeExpertBuffers& a, const MoeExpertWeights& w,
                          const MoeRouting& r, const Tensor& d_swiglu, const Tensor& d_gate_up) {
  check_routing(r, "moe_experts_backward");
  check_experts(w, r, a.permuted.dim(1), "moe_experts_backward");
  check_experts(grads, r, a.permuted.dim(1), "moe_experts_backward gradients");
  for (int64_t e = 0; e < r.experts; ++e) {
    const int64_t b = r.offsets[static_cast<size_t>(e)], end = r.offsets[static_cast<size_t>(e) + 1];
    if (b == end) {  // no rows: a zero gradient when written over, nothing to add otherwise
      if (overwrite) {
        expert_matrix(grads.gate_up, e).fill_zero();
        expert_matrix(grads.down, e).fill_zero();
      }
      continue;
    }
    linear_backward(d_swiglu.narrow(b, end), {expert_matrix(grads.down, e)}, d_expert_out.narrow(b, end),
                    a.swiglu.narrow(b, end), {expert_matrix(w.down, e)}, overwrite);
    swiglu_backward(d_gate_up.narrow(b, end), d_swiglu.narrow(b, end), a.gate_up.narrow(b, end));
    linear_backward(d_permuted.narrow(b, end), {expert_matrix(grads.gate_up, e)}, d_gate_up.narrow(b, end),
                    a.permuted.narrow(b, end), {expert_matrix(w.gate_up, e)}, overwrite);
  }
}

}  // namespace forge
