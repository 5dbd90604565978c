#include "ops/linear.h"

#include <utility>

#include "ops/bias.h"
#include "ops/gelu.h"
#include "ops/lora.h"
#include "ops/matmul.h"
#include "ops/nf4.h"
#include "ops/nf4_fp8.h"

namespace forge {
namespace {

// The weight the GEMM reads: an NF4 layer's codes dequantized into its scratch buffer
// first (NOTE [NF4 linear weights]); an FP8 GEMM then casts that scratch (NOTE [FP8 over
// an NF4 base]).
const Tensor& compute_weight(const LinearWeight& w) {
  if (w.nf4) nf4_dequantize(w.weight, *w.nf4);
  return w.weight;
}

// A weight the GEMM takes as it is, with nothing else to add (no FP8, NF4 or adapter):
// the one kind whose bias and GELU can ride in the GEMM's epilogue (NOTE [GEMM epilogues]).
bool plain(const LinearWeight& w) { return !w.fp8 && !w.nf4 && !w.lora && !w.fp8_gathered; }

}  // namespace

// The weight is [out, in]: the forward multiplies by its transpose, the input gradient by
// the weight itself, and the weight gradient is dy^T x; every transpose is a GEMM flag
// (NOTE [Contiguous tensors]).

void linear_forward(const Tensor& y, const Tensor& x, const LinearWeight& w, const Tensor* residual) {
  FORGE_CHECK(!(w.nf4 && w.fp8_gathered), "linear_forward: an NF4 weight has no gathered FP8 codes");
  if (w.bias.defined() && plain(w) &&
      matmul_epilogue(MatmulEpilogue::Bias, y, x, false, w.weight, true, residual ? 1.0f : 0.0f, residual, w.bias))
    return;
  FORGE_CHECK(w.fp8 || !w.fp8_gathered, "linear_forward: gathered FP8 codes without FP8 settings");
  if (nf4_fp8_straight(w)) {  // NOTE [FP8 straight from NF4]
    const Nf4Fp8Codes q = nf4_fp8_codes(w);
    fp8_linear_forward(y, x, q.codes, *w.fp8, residual, &q.cast);
  } else if (w.fp8)
    fp8_linear_forward(y, x, compute_weight(w), *w.fp8, residual, w.fp8_gathered);
  else if (residual)
    matmul_add(y, x, false, compute_weight(w), true, *residual);
  else
    matmul(y, x, false, compute_weight(w), true);
  if (w.lora) lora_forward_add(y, x, *w.lora);
  if (w.bias.defined()) add_bias(y, w.bias);  // NOTE [Linear bias]
}

void linear_backward_input(const Tensor& dx, const Tensor& dy, const LinearWeight& w) {
  FORGE_CHECK(!(w.nf4 && w.fp8_gathered), "linear_backward_input: an NF4 weight has no gathered FP8 codes");
  if (nf4_fp8_straight(w)) {
    const Nf4Fp8Codes q = nf4_fp8_codes(w);
    fp8_linear_backward_input(dx, dy, q.codes, *w.fp8, &q.cast);
  } else if (w.fp8)
    fp8_linear_backward_input(dx, dy, compute_weight(w), *w.fp8, w.fp8_gathered);
  else
    matmul(dx, dy, false, compute_weight(w), false);
  if (w.lora) lora_backward_input_add(dx, dy, *w.lora);
}

void linear_backward_input_add(const Tensor& dx, const Tensor& dy, const LinearWeight& w) {
  FORGE_CHECK(!(w.nf4 && w.fp8_gathered), "linear_backward_input_add: an NF4 weight has no gathered FP8 codes");
  if (nf4_fp8_straight(w)) {
    const Nf4Fp8Codes q = nf4_fp8_codes(w);
    fp8_linear_backward_input_add(dx, dy, q.codes, *w.fp8, &q.cast);
  } else if (w.fp8)
    fp8_linear_backward_input_add(dx, dy, compute_weight(w), *w.fp8, w.fp8_gathered);
  else
    matmul_add(dx, dy, false, compute_weight(w), false, dx);
  if (w.lora) lora_backward_input_add(dx, dy, *w.lora);
}

void linear_backward_weight(const LinearWeight& grad, const Tensor& dy, const Tensor& x, bool overwrite) {
  FORGE_CHECK(!grad.nf4, "linear_backward_weight: an NF4 weight is frozen and has no gradient");
  if (grad.weight.defined() && grad.bias.defined() && overwrite && plain(grad) &&
      matmul_epilogue(MatmulEpilogue::BiasGradient, grad.weight, dy, true, x, false, 0.0f, nullptr, grad.bias))
    return;
  if (grad.weight.defined() && grad.fp8)
    fp8_linear_backward_weight(grad.weight, dy, x, *grad.fp8, overwrite);
  else if (grad.weight.defined())
    matmul(grad.weight, dy, true, x, false, 1.0f, overwrite ? 0.0f : 1.0f);
  if (grad.lora) lora_backward_weight(*grad.lora, dy, x, overwrite);
  if (grad.bias.defined()) bias_gradient(grad.bias, dy, overwrite);
}

void linear_backward(const Tensor& dx, const LinearWeight& grad, const Tensor& dy, const Tensor& x,
                     const LinearWeight& w, bool overwrite) {
  if (w.fp8 && grad.fp8 && grad.weight.defined() && !w.nf4 && !w.lora && !grad.lora) {
    fp8_linear_backward(dx, grad.weight, dy, w.weight, x, *grad.fp8, overwrite, w.fp8_gathered);
    if (grad.bias.defined()) bias_gradient(grad.bias, dy, overwrite);
    return;
  }
  linear_backward_input(dx, dy, w);
  linear_backward_weight(grad, dy, x, overwrite);
}

void linear_gelu_forward(const Tensor& a, const Tensor& h, const Tensor& x, const LinearWeight& w) {
  if (w.bias.defined() && plain(w) &&
      matmul_epilogue(MatmulEpilogue::GeluAuxBias, a, x, false, w.weight, true, 0.0f, nullptr, w.bias, &h))
    return;
  linear_forward(h, x, w);
  gelu_tanh_forward(a, h);
}

void linear_gelu_backward(const Tensor& dh, const Tensor& da, const LinearWeight& grad, const Tensor& dy,
                          const Tensor& a, const LinearWeight& w, const Tensor& h, bool overwrite) {
  if (!(plain(w) && matmul_epilogue(MatmulEpilogue::DGelu, dh, dy, false, w.weight, false, 0.0f, nullptr, Tensor(), &h))) {
    linear_backward_input(da, dy, w);
    gelu_tanh_backward(dh, da, h);
  }
  linear_backward_weight(grad, dy, a, overwrite);
}

namespace {

// The two inputs' widths, checked against the weight [out, in1 + in2] (NOTE [Linear over
// concatenated inputs]); refuses a descriptor that is not a plain weight.
std::pair<int64_t, int64_t> concat_widths(const char* op, const Tensor& x1, const Tensor& x2, const LinearWeight& w,
                                          const LinearWeight* grad = nullptr) {
  FORGE_CHECK(plain(w) && (!grad || plain(*grad)),
              "{}: takes a plain weight only (no LoRA adapter, FP8 or NF4; NOTE [Linear over concatenated inputs])",
              op);
  FORGE_CHECK(x1.ndim() == 2 && x2.ndim() == 2 && x1.dim(0) == x2.dim(0),
              "{}: the inputs {} and {} must be [rows, features] with the same rows", op, shape_str(x1.shape()),
              shape_str(x2.shape()));
  FORGE_CHECK(w.weight.ndim() == 2 && w.weight.dim(1) == x1.dim(1) + x2.dim(1),
              "{}: weight {} for inputs of {} + {} features", op, shape_str(w.weight.shape()), x1.dim(1), x2.dim(1));
  return {x1.dim(1), x2.dim(1)};
}

}  // namespace

void linear_concat_forward(const Tensor& y, const Tensor& x1, const Tensor& x2, const LinearWeight& w) {
  const auto [in1, in2] = concat_widths("linear_concat_forward", x1, x2, w);
  const ColumnBlock w1 = column_block(w.weight, 0, in1), w2 = column_block(w.weight, in1, in2);
  const bool biased = w.bias.defined() && matmul_blocks_epilogue(MatmulEpilogue::Bias, all_columns(y), x1, false, w1,
                                                                 true, 0.0f, nullptr, w.bias);
  if (!biased) matmul_blocks(all_columns(y), x1, false, w1, true, 0.0f);
  matmul_blocks(all_columns(y), x2, false, w2, true, 1.0f);
  if (w.bias.defined() && !biased) add_bias(y, w.bias);  // NOTE [Linear bias]
}

void linear_concat_gelu_backward(const Tensor& dx1, const Tensor& dh2, const Tensor& da2, const LinearWeight& grad,
                                 const Tensor& dy, const Tensor& x1, const Tensor& x2, const LinearWeight& w,
                                 const Tensor& h2, bool overwrite) {
  const auto [in1, in2] = concat_widths("linear_concat_gelu_backward", x1, x2, w, &grad);
  const ColumnBlock w1 = column_block(w.weight, 0, in1), w2 = column_block(w.weight, in1, in2);
  matmul_blocks(all_columns(dx1), dy, false, w1, false, 0.0f);
  if (!matmul_blocks_epilogue(MatmulEpilogue::DGelu, all_columns(dh2), dy, false, w2, false, 0.0f, nullptr, Tensor(),
                              &h2)) {
    matmul_blocks(all_columns(da2), dy, false, w2, false, 0.0f);
    gelu_tanh_backward(dh2, da2, h2);
  }
  bool bias_done = false;
  if (grad.weight.defined()) {
    FORGE_CHECK(grad.weight.ndim() == 2 && grad.weight.shape() == w.weight.shape(),
                "linear_concat_gelu_backward: weight gradient {} for a weight {}", shape_str(grad.weight.shape()),
                shape_str(w.weight.shape()));
    const ColumnBlock g1 = column_block(grad.weight, 0, in1), g2 = column_block(grad.weight, in1, in2);
    const float beta = overwrite ? 0.0f : 1.0f;
    bias_done = grad.bias.defined() && overwrite &&
                matmul_blocks_epilogue(MatmulEpilogue::BiasGradient, g1, dy, true, all_columns(x1), false, 0.0f,
                                       nullptr, grad.bias);
    if (!bias_done) matmul_blocks(g1, dy, true, all_columns(x1), false, beta);
    matmul_blocks(g2, dy, true, all_columns(x2), false, beta);
  }
  if (grad.bias.defined() && !bias_done) bias_gradient(grad.bias, dy, overwrite);  // NOTE [Linear bias]
}

}  // namespace forge
