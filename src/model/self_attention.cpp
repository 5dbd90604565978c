#include "model/self_attention.h"

#include <cmath>

#include <fmt/format.h>

#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace forge {

SelfAttention::SelfAttention(const ModelConfig& config)
    : hidden_(config.hidden_size),
      heads_(config.num_heads),
      kv_heads_(config.num_kv_heads),
      head_dim_(config.resolved_head_dim()),
      eps_(static_cast<float>(config.norm_eps)),
      rotary_(config.resolved_head_dim(), config.rope_theta, config.rope_scaling),
      attention_{config.num_heads, config.num_kv_heads, config.sliding_window,
                 1.0f / std::sqrt(static_cast<float>(config.resolved_head_dim())), config.resolved_head_dim()} {}

std::vector<ParamSpec> SelfAttention::param_specs(int layer) const {
  const std::string p = fmt::format("layers.{}.", layer), hf = fmt::format("model.layers.{}.", layer);
  const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
  std::vector<ParamSpec> specs(3);
  specs[kNorm] = {p + "attn_norm.weight", {hidden_}, {{hf + "input_layernorm.weight", hidden_}}, false, layer};
  specs[kQkv] = {p + "attention.qkv.weight",
                 {q + 2 * kv, hidden_},
                 {{hf + "self_attn.q_proj.weight", q}, {hf + "self_attn.k_proj.weight", kv},
                  {hf + "self_attn.v_proj.weight", kv}},
                 true,
                 layer};
  specs[kOut] = {p + "attention.o.weight", {hidden_, q}, {{hf + "self_attn.o_proj.weight", hidden_}}, true, layer,
                 true};
  return specs;
}

void SelfAttention::lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) {
  shape_ = shape;
  const int64_t n = shape.tokens(), b = shape.micro_batch, t = shape.seq_len;
  auto act = [&](Shape s) { return layout.take(std::move(s), shape.dtype); };
  auto stat = [&](Shape s) { return layout.take(std::move(s), DType::F32); };
  // The GEMM and attention outputs (and the statistics beside them) are costly to
  // recompute; the normalized input is not.
  auto costly = [&](Activations& a) {
    a.rstd = stat({n});
    a.qkv = act({b, t, heads_ + 2 * kv_heads_, head_dim_});
    a.out = act({b, t, heads_, head_dim_});
    a.lse = stat({b, heads_, t});
  };
  auto cheap = [&](Activations& a) { a.normed = act({n, hidden_}); };
  layers_ = lay_out_layers<Activations>(num_layers, mode, costly, cheap);
  d_out_ = act({n, heads_ * head_dim_});
  d_qkv_ = act({b, t, heads_ + 2 * kv_heads_, head_dim_});
}

void SelfAttention::prepare(const StepShape& shape, Device device) { rotary_.prepare(shape.seq_len, device); }

void SelfAttention::set_sequence_layout(const SequenceLayout* layout) { rotary_.set_layout(layout, attention_); }

void SelfAttention::forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  const int64_t n = shape_.tokens();
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_, &w.linear(kQkv));
  linear_forward(a.qkv.view({n, (heads_ + 2 * kv_heads_) * head_dim_}), a.normed, w.linear(kQkv));
  rope_forward(a.qkv, heads_ + kv_heads_, rotary_.cos(), rotary_.sin(), rotary_.positions());
  attention_forward(a.out, a.lse, a.qkv, attention_, rotary_.segments());
  if (!out) return;
  linear_forward(*out, a.out.view({n, heads_ * head_dim_}), w.linear(kOut), &x);
}

void SelfAttention::recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_);
}

void SelfAttention::backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite,
                             const Tensor& x, const Tensor& d_stream, const Tensor& d_hidden) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  const int64_t n = shape_.tokens();
  if (overwrite) grads.tensor(kNorm).fill_zero();  // the norm's backward adds
  // out = x + attention_out @ o^T
  linear_backward(d_out_, grads.linear(kOut), d_stream, a.out.view({n, heads_ * head_dim_}), w.linear(kOut), overwrite);
  attention_backward(d_qkv_, d_out_.view({shape_.micro_batch, shape_.seq_len, heads_, head_dim_}), a.qkv, a.out,
                     a.lse, attention_, rotary_.segments());
  rope_backward(d_qkv_, heads_ + kv_heads_, rotary_.cos(), rotary_.sin(), rotary_.positions());
  const Tensor d_qkv = d_qkv_.view({n, (heads_ + 2 * kv_heads_) * head_dim_});
  linear_backward(d_hidden, grads.linear(kQkv), d_qkv, a.normed, w.linear(kQkv), overwrite);
  rmsnorm_backward(d_stream, grads.tensor(kNorm), d_hidden, x, w.tensor(kNorm), a.rstd);
}

}  // namespace forge
