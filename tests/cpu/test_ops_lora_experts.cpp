// LoRA on the routed experts (NOTE [LoRA on routed experts] in ops/lora_experts.h) on the CPU:
// the experts' GEMMs with adapters against the same GEMMs on the merged weights
// W_e + scale B_e A_e, dropless and padded to capacity (the batched path), with an expert
// that gets no rows: the forward output and the input gradient equal the merged weights', and
// the adapters' gradients are the merged weights' gradient dW_e folded through the other
// factor, dA_e = scale B_e^T dW_e and dB_e = scale dW_e A_e^T (the chain rule through
// W_e + scale B_e A_e); written over or added to as the backward is told. The whole model's
// adapter gradients against finite differences are in test_model_lora_moe.cpp, PEFT's in
// tests/python/test_lora_moe_vs_peft.py.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/lora_experts.h"
#include "ops/matmul.h"
#include "ops/moe.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_l2;

struct Stack {
  Tensor weight;                      // [E, out, in]
  Tensor a, b, grad_a, grad_b;        // [E r, in], [E out, r]
  LoraExpertAdapter adapter;
};

Stack make_stack(int64_t experts, int64_t out, int64_t in, int64_t rank, float scale, LoraExpertWorkspace* ws,
                 Rng& rng) {
  Stack s;
  s.weight = random_tensor({experts, out, in}, rng, 0.3);
  s.a = random_tensor({experts * rank, in}, rng, 0.3);
  s.b = random_tensor({experts * out, rank}, rng, 0.3);
  s.grad_a = Tensor::zeros({experts * rank, in});
  s.grad_b = Tensor::zeros({experts * out, rank});
  s.adapter = {s.a, s.b, s.grad_a, s.grad_b, rank, experts, scale, ws};
  return s;
}

// W_e + scale B_e A_e for every expert.
Tensor merged(const Stack& s) {
  Tensor w = s.weight.clone();
  const int64_t e_count = w.dim(0), out = w.dim(1), in = w.dim(2), r = s.adapter.rank;
  for (int64_t e = 0; e < e_count; ++e)
    matmul(w.narrow(e, e + 1).view({out, in}), s.b.narrow(e * out, (e + 1) * out), false,
           s.a.narrow(e * r, (e + 1) * r), false, s.adapter.scale, 1.0f);
  return w;
}

void check_case(const MoeCapacity& capacity, const char* label) {
  SCOPED_TRACE(label);
  const int64_t tokens = 9, hidden = 8, ffn = 6, experts = 4, k = 2, rank = 3;
  const float scale = 1.7f;
  Rng rng(21);
  Tensor logits = random_tensor({tokens, experts}, rng, 2.0);
  for (int64_t t = 0; t < tokens; ++t) logits.data<float>()[t * experts + 3] = -40.0f;  // expert 3: no tokens
  const MoeRouting routing = moe_route_softmax(logits, k, 1, 1, true, 1.0f, {}, capacity);
  ASSERT_EQ(routing.rows(3), capacity.pad ? routing.capacity : 0);
  const int64_t rows = routing.permuted_rows();
  LoraExpertWorkspace ws{Tensor::zeros({rank * rows}), Tensor::zeros({rank * rows})};
  Stack gate_up = make_stack(experts, 2 * ffn, hidden, rank, scale, &ws, rng);
  Stack down = make_stack(experts, hidden, ffn, rank, scale, &ws, rng);

  const Tensor x = random_tensor({tokens, hidden}, rng);
  auto buffers = [&] {
    return MoeExpertBuffers{Tensor::zeros({rows, hidden}), Tensor::zeros({rows, 2 * ffn}), Tensor::zeros({rows, ffn}),
                            Tensor::zeros({rows, hidden})};
  };
  const MoeExpertBuffers with = buffers(), plain = buffers();
  moe_permute(with.permuted, x, routing);
  moe_permute(plain.permuted, x, routing);
  MoeExpertWeights adapted{gate_up.weight, down.weight, &gate_up.adapter, &down.adapter};
  const MoeExpertWeights merged_weights{merged(gate_up), merged(down)};
  moe_experts_forward(with, adapted, routing);
  moe_experts_forward(plain, merged_weights, routing);
  EXPECT_LT(relative_l2(with.gate_up, plain.gate_up), 1e-6);
  EXPECT_LT(relative_l2(with.expert_out, plain.expert_out), 1e-6);

  const Tensor d_out = random_tensor({rows, hidden}, rng);
  Tensor dx_with = Tensor::zeros({rows, hidden}), dx_plain = Tensor::zeros({rows, hidden});
  const Tensor d_swiglu = Tensor::zeros({rows, ffn}), d_gate_up = Tensor::zeros({rows, 2 * ffn});
  // Frozen base: the gradient descriptor holds the adapters alone.
  const MoeExpertWeights frozen{Tensor(), Tensor(), &gate_up.adapter, &down.adapter};
  for (const Tensor& g : {gate_up.grad_a, down.grad_b})  // written over
    for (int64_t i = 0; i < g.numel(); ++i) g.data<float>()[i] = 5.0f;
  moe_experts_backward(dx_with, frozen, true, d_out, with, adapted, routing, d_swiglu, d_gate_up);
  const MoeExpertWeights dw{Tensor::zeros(gate_up.weight.shape()), Tensor::zeros(down.weight.shape())};
  moe_experts_backward(dx_plain, dw, true, d_out, plain, merged_weights, routing, d_swiglu, d_gate_up);
  EXPECT_LT(relative_l2(dx_with, dx_plain), 1e-6);

  for (const auto& [stack, grad, name] : {std::tuple{&gate_up, dw.gate_up, "gate_up"}, {&down, dw.down, "down"}}) {
    SCOPED_TRACE(name);
    const int64_t out = stack->weight.dim(1), in = stack->weight.dim(2);
    Tensor want_a = Tensor::zeros(stack->a.shape()), want_b = Tensor::zeros(stack->b.shape());
    for (int64_t e = 0; e < experts; ++e) {
      const Tensor dw_e = grad.narrow(e, e + 1).view({out, in});
      matmul(want_a.narrow(e * rank, (e + 1) * rank), stack->b.narrow(e * out, (e + 1) * out), true, dw_e, false,
             scale);
      matmul(want_b.narrow(e * out, (e + 1) * out), dw_e, false, stack->a.narrow(e * rank, (e + 1) * rank), true,
             scale);
    }
    EXPECT_LT(relative_l2(stack->grad_a, want_a), 1e-5);
    EXPECT_LT(relative_l2(stack->grad_b, want_b), 1e-5);
    // Expert 3 saw no rows: its gradient is zero when written over (padding: zero rows).
    for (int64_t i = 3 * rank * in; i < 4 * rank * in; ++i) ASSERT_EQ(stack->grad_a.data<float>()[i], 0.0f);
  }

  // Added to when not written over: a second backward doubles the gradients.
  const Tensor once_a = gate_up.grad_a.clone(), once_b = down.grad_b.clone();
  moe_experts_backward(dx_with, frozen, false, d_out, with, adapted, routing, d_swiglu, d_gate_up);
  for (int64_t i = 0; i < once_a.numel(); ++i)
    ASSERT_NEAR(gate_up.grad_a.data<float>()[i], 2.0f * once_a.data<float>()[i], 1e-5f);
  for (int64_t i = 0; i < once_b.numel(); ++i)
    ASSERT_NEAR(down.grad_b.data<float>()[i], 2.0f * once_b.data<float>()[i], 1e-5f);
}

TEST(OpsLoraExperts, MatchTheMergedWeightsDropless) { check_case({}, "dropless"); }

TEST(OpsLoraExperts, MatchTheMergedWeightsPaddedToCapacity) { check_case({2.0, false, true}, "padded"); }

TEST(OpsLoraExperts, RefuseAWorkspaceTooSmall) {
  Rng rng(3);
  LoraExpertWorkspace ws{Tensor::zeros({2}), Tensor::zeros({2})};
  Stack s = make_stack(2, 4, 5, 2, 1.0f, &ws, rng);
  const Tensor logits = random_tensor({6, 2}, rng);
  const MoeRouting routing = moe_route_softmax(logits, 1, 1, 1, true, 1.0f);
  const Tensor x = random_tensor({6, 5}, rng), y = Tensor::zeros({6, 4});
  EXPECT_THROW(lora_experts_forward_add(y, x, s.adapter, routing), Error);
}

}  // namespace
}  // namespace forge
