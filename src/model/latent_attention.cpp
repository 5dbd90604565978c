#include "model/latent_attention.h"

#include <cmath>

#include <fmt/format.h>

#include "ops/linear.h"
#include "ops/nf4.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace forge {

LatentAttention::LatentAttention(const ModelConfig& config)
    : hidden_(config.hidden_size),
      heads_(config.num_heads),
      q_rank_(config.q_lora_rank),
      kv_rank_(config.kv_lora_rank),
      dims_{config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, 0},
      eps_(static_cast<float>(config.norm_eps)),
      rotary_(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling) {
  attention_.num_q_heads = heads_;
  attention_.num_kv_heads = heads_;
  attention_.sliding_window = 0;
  attention_.scale = static_cast<float>(rope_softmax_scale(config.rope_scaling) /
                                        std::sqrt(static_cast<double>(config.qk_head_dim())));
  attention_.head_dim = config.qk_head_dim();
  attention_.v_head_dim = config.v_head_dim;
  size_t next = 0;
  p_.norm = next++;
  if (q_rank_ > 0) {
    p_.q_a = next++;
    p_.q_a_norm = next++;
    p_.q_b = next++;
  } else {
    p_.q = next++;
  }
  p_.kv_a = next++;
  p_.kv_a_norm = next++;
  p_.kv_b = next++;
  p_.out = next++;
  p_.count = next;
}

// Hugging Face's names are DeepseekV2Attention's / DeepseekV3Attention's; the rotary rows of
// the query projection and of k_pe are reordered on the way in and out (NOTE [Multi-head
// Latent Attention]).
std::vector<ParamSpec> LatentAttention::param_specs(int layer) const {
  const std::string p = fmt::format("layers.{}.", layer), hf = fmt::format("model.layers.{}.self_attn.", layer);
  const int64_t qk = dims_.nope_dim + dims_.rope_dim, q_width = heads_ * qk;
  // In each head's qk rows, the last rope_dim are rotary.
  const HfRotaryRows q_rotary{qk, dims_.nope_dim, dims_.rope_dim};
  std::vector<ParamSpec> specs(p_.count);
  specs[p_.norm] = {p + "attn_norm.weight", {hidden_}, {{fmt::format("model.layers.{}.input_layernorm.weight", layer),
                                                         hidden_}}, false, layer};
  if (q_rank_ > 0) {
    specs[p_.q_a] = {p + "attention.q_a.weight", {q_rank_, hidden_}, {{hf + "q_a_proj.weight", q_rank_}}, true, layer};
    specs[p_.q_a_norm] = {p + "attention.q_a_norm.weight", {q_rank_}, {{hf + "q_a_layernorm.weight", q_rank_}}, false,
                          layer};
    specs[p_.q_b] = {p + "attention.q_b.weight", {q_width, q_rank_}, {{hf + "q_b_proj.weight", q_width, q_rotary}},
                     true, layer};
  } else {
    specs[p_.q] = {p + "attention.q.weight", {q_width, hidden_}, {{hf + "q_proj.weight", q_width, q_rotary}}, true,
                   layer};
  }
  const int64_t kv_a_rows = kv_rank_ + dims_.rope_dim;
  specs[p_.kv_a] = {p + "attention.kv_a.weight",
                    {kv_a_rows, hidden_},
                    {{hf + "kv_a_proj_with_mqa.weight", kv_a_rows, HfRotaryRows{kv_a_rows, kv_rank_, dims_.rope_dim}}},
                    true,
                    layer};
  specs[p_.kv_a_norm] = {p + "attention.kv_a_norm.weight", {kv_rank_}, {{hf + "kv_a_layernorm.weight", kv_rank_}},
                         false, layer};
  const int64_t kv_width = heads_ * (dims_.nope_dim + dims_.v_dim);
  specs[p_.kv_b] = {p + "attention.kv_b.weight", {kv_width, kv_rank_}, {{hf + "kv_b_proj.weight", kv_width}}, true,
                    layer};
  specs[p_.out] = {p + "attention.o.weight", {hidden_, heads_ * dims_.v_dim}, {{hf + "o_proj.weight", hidden_}}, true,
                   layer, true};
  return specs;
}

void LatentAttention::lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode,
                              int num_layers) {
  shape_ = shape;
  const int64_t n = shape.tokens(), b = shape.micro_batch, t = shape.seq_len;
  const int64_t packed = dims_.packed_width();
  auto act = [&](Shape s) { return layout.take(std::move(s), shape.dtype); };
  auto stat = [&](Shape s) { return layout.take(std::move(s), DType::F32); };
  // The GEMM and attention outputs the backward reads (and the statistics beside them) are
  // costly to recompute; the norms' outputs are not.
  auto costly = [&](Activations& a) {
    a.rstd = stat({n});
    if (q_rank_ > 0) {
      a.q_a = act({n, q_rank_});
      a.q_rstd = stat({n});
    }
    a.kv_a = act({n, kv_rank_});
    a.kv_rstd = stat({n});
    a.qkv = act({b, t, packed});
    a.out = act({b, t, heads_, dims_.v_dim});
    a.lse = stat({b, heads_, t});
  };
  auto cheap = [&](Activations& a) {
    a.normed = act({n, hidden_});
    if (q_rank_ > 0) a.q_compressed = act({n, q_rank_});
    a.kv_compressed = act({n, kv_rank_});
  };
  layers_ = lay_out_layers<Activations>(num_layers, mode, costly, cheap);
  const int64_t q_width = heads_ * (dims_.nope_dim + dims_.rope_dim), kv_width = heads_ * (dims_.nope_dim + dims_.v_dim);
  q_ = act({n, q_width});
  k_pe_ = act({n, dims_.rope_dim});
  kv_ = act({n, kv_width});
  d_out_ = act({n, heads_ * dims_.v_dim});
  d_qkv_ = act({b, t, packed});
  d_q_ = act({n, q_width});
  d_k_pe_ = act({n, dims_.rope_dim});
  d_kv_ = act({n, kv_width});
  d_kv_compressed_ = act({n, kv_rank_});
  d_kv_a_ = act({n, kv_rank_});
  if (q_rank_ > 0) {
    d_q_compressed_ = act({n, q_rank_});
    d_q_a_ = act({n, q_rank_});
  }
}

void LatentAttention::prepare(const StepShape& shape, Device device) { rotary_.prepare(shape.seq_len, device); }

void LatentAttention::set_sequence_layout(const SequenceLayout* layout) { rotary_.set_layout(layout, attention_); }

Tensor LatentAttention::attention_rows(const Tensor& packed) const {
  return packed.view(attention_.qkv_shape(packed.dim(0), packed.dim(1)));
}

LinearWeight LatentAttention::rows(const LinearWeight& w, int64_t begin, int64_t end, LoraAdapter& view,
                                   bool later) {
  if (w.nf4) nf4_dequantize(w.weight, *w.nf4);  // NOTE [NF4 linear weights]: the rows view the scratch
  LinearWeight part;
  // NOTE [FP8 latent attention] in latent_attention.h: both row ranges share kv_a's FP8 settings.
  part.fp8 = w.fp8;
  // FSDP's FP8 all-gather: kv_a's codes came as two pieces, the compressed rows' scale
  // first, the rotary rows' second (NOTE [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h).
  if (w.fp8_gathered) part.fp8_gathered = w.fp8_gathered + (later ? 1 : 0);
  if (w.weight.defined()) part.weight = w.weight.narrow(begin, end).view({end - begin, w.weight.dim(1)});
  if (w.lora) {
    view = lora_rows(*w.lora, begin, end, later);
    part.lora = &view;
  }
  return part;
}

void LatentAttention::project_queries(Activations& a, const ComponentWeights& w) {
  if (q_rank_ == 0) {
    linear_forward(q_, a.normed, w.linear(p_.q));
    return;
  }
  linear_forward(a.q_a, a.normed, w.linear(p_.q_a));
  rmsnorm_forward(a.q_compressed, a.q_rstd, a.q_a, w.tensor(p_.q_a_norm), eps_);
  linear_forward(q_, a.q_compressed, w.linear(p_.q_b));
}

void LatentAttention::forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  const int64_t n = shape_.tokens();
  const LinearWeight& kv_a = w.linear(p_.kv_a);
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(p_.norm), eps_);
  project_queries(a, w);
  linear_forward(a.kv_a, a.normed, rows(kv_a, 0, kv_rank_, kv_a_rows_[0], false));
  linear_forward(k_pe_, a.normed, rows(kv_a, kv_rank_, kv_rank_ + dims_.rope_dim, kv_a_rows_[1], true));
  rmsnorm_forward(a.kv_compressed, a.kv_rstd, a.kv_a, w.tensor(p_.kv_a_norm), eps_);
  linear_forward(kv_, a.kv_compressed, w.linear(p_.kv_b));
  mla_pack_qkv(a.qkv, q_, k_pe_, kv_, dims_, rotary_.cos(), rotary_.sin(), rotary_.positions());
  attention_forward(a.out, a.lse, attention_rows(a.qkv), attention_, rotary_.segments());
  if (!out) return;
  linear_forward(*out, a.out.view({n, heads_ * dims_.v_dim}), w.linear(p_.out), &x);
}

void LatentAttention::recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(p_.norm), eps_);
  if (q_rank_ > 0) rmsnorm_forward(a.q_compressed, a.q_rstd, a.q_a, w.tensor(p_.q_a_norm), eps_);
  rmsnorm_forward(a.kv_compressed, a.kv_rstd, a.kv_a, w.tensor(p_.kv_a_norm), eps_);
}

void LatentAttention::backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite,
                               const Tensor& x, const Tensor& d_stream, const Tensor& d_hidden) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  const int64_t n = shape_.tokens();
  if (overwrite) {  // the norms' backwards add
    grads.tensor(p_.norm).fill_zero();
    grads.tensor(p_.kv_a_norm).fill_zero();
    if (q_rank_ > 0) grads.tensor(p_.q_a_norm).fill_zero();
  }
  // out = x + attention_out @ o^T
  linear_backward(d_out_, grads.linear(p_.out), d_stream, a.out.view({n, heads_ * dims_.v_dim}), w.linear(p_.out),
                  overwrite);
  attention_backward(attention_rows(d_qkv_), d_out_.view({shape_.micro_batch, shape_.seq_len, heads_, dims_.v_dim}),
                     attention_rows(a.qkv), a.out, a.lse, attention_, rotary_.segments());
  mla_pack_qkv_backward(d_q_, d_k_pe_, d_kv_, d_qkv_, dims_, rotary_.cos(), rotary_.sin(), rotary_.positions());
  // kv = rmsnorm(h W_kva[:r]^T) W_kvb^T
  linear_backward(d_kv_compressed_, grads.linear(p_.kv_b), d_kv_, a.kv_compressed, w.linear(p_.kv_b), overwrite);
  d_kv_a_.fill_zero();  // the norm's backward adds
  rmsnorm_backward(d_kv_a_, grads.tensor(p_.kv_a_norm), d_kv_compressed_, a.kv_a, w.tensor(p_.kv_a_norm), a.kv_rstd);
  // dL/dh: through the queries (written), then the two parts of kv_a (added).
  if (q_rank_ > 0) {
    linear_backward(d_q_compressed_, grads.linear(p_.q_b), d_q_, a.q_compressed, w.linear(p_.q_b), overwrite);
    d_q_a_.fill_zero();
    rmsnorm_backward(d_q_a_, grads.tensor(p_.q_a_norm), d_q_compressed_, a.q_a, w.tensor(p_.q_a_norm), a.q_rstd);
    linear_backward(d_hidden, grads.linear(p_.q_a), d_q_a_, a.normed, w.linear(p_.q_a), overwrite);
  } else {
    linear_backward(d_hidden, grads.linear(p_.q), d_q_, a.normed, w.linear(p_.q), overwrite);
  }
  const LinearWeight& kv_a = w.linear(p_.kv_a);
  const LinearWeight& kv_a_grad = grads.linear(p_.kv_a);
  const int64_t end = kv_rank_ + dims_.rope_dim;
  const LinearWeight compressed = rows(kv_a, 0, kv_rank_, kv_a_rows_[0], false);
  const LinearWeight rotary = rows(kv_a, kv_rank_, end, kv_a_rows_[1], true);
  linear_backward_weight(rows(kv_a_grad, 0, kv_rank_, kv_a_grad_rows_[0], false), d_kv_a_, a.normed, overwrite);
  linear_backward_input_add(d_hidden, d_kv_a_, compressed);
  linear_backward_weight(rows(kv_a_grad, kv_rank_, end, kv_a_grad_rows_[1], true), d_k_pe_, a.normed, overwrite);
  linear_backward_input_add(d_hidden, d_k_pe_, rotary);
  rmsnorm_backward(d_stream, grads.tensor(p_.norm), d_hidden, x, w.tensor(p_.norm), a.rstd);
}

}  // namespace forge
