// A MoE feed-forward's routed experts without its RMSNorm or shared experts, composed from the
// MoE ops (ops/moe.h) and the linear op: out = x + sum_j w_j * expert_j(x), with Mixtral's
// softmax routing or DeepSeek-V3's sigmoid routing, and its backward. Shared by
// test_ops_moe.cpp (against finite differences) and tools/forge_moe_reference.cpp (against
// transformers' MixtralSparseMoeBlock and DeepseekV3TopkRouter + DeepseekV3Experts).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops/linear.h"
#include "ops/moe.h"

namespace forge::testing {

struct MoeLayer {
  int64_t hidden, ffn, experts, k;
  bool normalize;
  Tensor router, gate_up, down;  // [E, H], [E, 2F, H], [E, H, F]
  float aux = 0.0f;              // the balancing loss's coefficient (softmax routing)
  // Which balancing loss (model.router_aux_loss_type): "pooled" (over this one layer),
  // "per_layer", "sequence" (the tokens are `sequences` rows of equal length) or "global"
  // (with tokens_per_expert counted over total_tokens tokens, below).
  std::string aux_type = "pooled";
  int64_t sequences = 1;
  float z = 0.0f;  // the router z-loss's coefficient
  // DeepSeek-V3's routing (moe_route_sigmoid) instead of Mixtral's.
  bool sigmoid = false;
  Tensor bias;  // [E] or undefined
  // Group-limited routing (sigmoid, or softmax as DeepSeek-V2's group_limited_greedy) and the
  // weights' scaling (routed_scaling_factor).
  int64_t groups = 1, topk_groups = 1;
  float scaling = 1.0f;
  MoeCapacity capacity;  // token dropping (NOTE [MoE capacity]); factor 0: dropless
  // The global form's counts: [E] tokens per expert over total_tokens tokens (every rank's,
  // averaged over a step's micro-batches: MoeStepCounts).
  std::vector<double> tokens_per_expert;
  double total_tokens = 0.0;
};

struct MoeActivations {
  Tensor logits;
  MoeRouting routing;
  Tensor permuted, gate_up, swiglu, expert_out;
  MoeExpertBuffers buffers() const { return {permuted, gate_up, swiglu, expert_out}; }
};

inline Tensor moe_forward(const MoeLayer& m, const Tensor& x, MoeActivations& a) {
  const int64_t tokens = x.dim(0);
  a.logits = Tensor::empty({tokens, m.experts});
  linear_forward(a.logits, x, {m.router});
  a.routing = m.sigmoid ? moe_route_sigmoid(a.logits, m.bias, m.k, m.groups, m.topk_groups, m.normalize, m.scaling,
                                            {}, m.capacity)
                        : moe_route_softmax(a.logits, m.k, m.groups, m.topk_groups, m.normalize, m.scaling, {},
                                            m.capacity);
  const int64_t rows = a.routing.permuted_rows();
  a.permuted = Tensor::empty({rows, m.hidden});
  a.gate_up = Tensor::empty({rows, 2 * m.ffn});
  a.swiglu = Tensor::empty({rows, m.ffn});
  a.expert_out = Tensor::empty({rows, m.hidden});
  moe_permute(a.permuted, x, a.routing);
  moe_experts_forward(a.buffers(), {m.gate_up, m.down}, a.routing);
  Tensor out = Tensor::empty(x.shape());
  moe_combine(out, a.expert_out, a.routing, &x);
  return out;
}

// The layer's balancing loss (its MoeBalance, unweighted) as m.aux_type says.
inline MoeBalance moe_layer_balance(const MoeLayer& m, const MoeActivations& a) {
  if (m.aux_type == "pooled") return moe_balancing_loss({&a.routing});
  if (m.aux_type == "global") return moe_switch_balancing_loss(a.routing, m.tokens_per_expert, m.total_tokens);
  return moe_grouped_balancing_loss(a.routing, m.aux_type == "sequence" ? m.sequences : 1);
}

struct MoeGrads {
  Tensor dx, router, gate_up, down;
};

inline MoeGrads moe_backward(const MoeLayer& m, const Tensor& x, const MoeActivations& a, const Tensor& dout) {
  const int64_t tokens = x.dim(0), rows = a.routing.permuted_rows();
  MoeGrads g{Tensor::empty(x.shape()), Tensor::empty(m.router.shape()), Tensor::empty(m.gate_up.shape()),
             Tensor::empty(m.down.shape())};
  std::fill_n(g.gate_up.data<float>(), g.gate_up.numel(), std::nanf(""));  // every expert's gradient is
  std::fill_n(g.down.data<float>(), g.down.numel(), std::nanf(""));        // written, those with no rows as 0
  Tensor d_expert_out = Tensor::empty({rows, m.hidden}), d_weights = Tensor::empty({tokens, m.k});
  moe_combine_backward(d_expert_out, d_weights, dout, a.expert_out, a.routing);
  Tensor d_swiglu = Tensor::empty({rows, m.ffn}), d_gate_up = Tensor::empty({rows, 2 * m.ffn});
  Tensor d_permuted = Tensor::empty({rows, m.hidden});
  moe_experts_backward(d_permuted, {g.gate_up, g.down}, true, d_expert_out, a.buffers(), {m.gate_up, m.down},
                       a.routing, d_swiglu, d_gate_up);
  Tensor dx_experts = Tensor::empty(x.shape()), d_logits = Tensor::empty({tokens, m.experts});
  moe_permute_backward(dx_experts, d_permuted, a.routing);
  Tensor aux_gradient;  // the layer's balancing loss's, times its coefficient
  if (m.aux != 0.0f) {
    const std::vector<double> gradient = moe_layer_balance(m, a).prob_gradient;
    const int64_t rows = static_cast<int64_t>(gradient.size()) / m.experts;
    aux_gradient = rows == 1 ? Tensor::empty({m.experts}) : Tensor::empty({rows, m.experts});
    for (size_t i = 0; i < gradient.size(); ++i) aux_gradient.data<float>()[i] = static_cast<float>(gradient[i] * m.aux);
  }
  const double z_scale = m.z != 0.0f ? 2.0 * m.z / static_cast<double>(tokens) : 0.0;
  moe_route_backward(d_logits, d_weights, a.routing, aux_gradient.defined() ? &aux_gradient : nullptr, z_scale);
  Tensor dx_router = Tensor::empty(x.shape());
  linear_backward(dx_router, {g.router}, d_logits, x, {m.router}, true);
  for (int64_t i = 0; i < x.numel(); ++i)
    g.dx.data<float>()[i] = dout.data<float>()[i] + dx_experts.data<float>()[i] + dx_router.data<float>()[i];
  return g;
}

}  // namespace forge::testing
