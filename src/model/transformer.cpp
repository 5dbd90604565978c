#include "model/transformer.h"

#include <algorithm>
#include <cmath>

#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

namespace forge {
namespace {

// NOTE [Chunked output head]
// The output projection and cross-entropy run over chunks of tokens: logits for one chunk
// are computed, turned into loss and (in training) into dlogits in place, and immediately
// pushed back through the projection (dx, dW). Only one chunk of logits ever exists: for
// Llama 3 (vocab 128256) at 8192 tokens full fp32 logits would take 4 GiB. A chunk holds
// as many rows as fit in kHeadChunkBytes (a power of two, at least kMinHeadChunkRows):
// the weight-gradient GEMM of every chunk reads and writes the whole fp32 dW (2 GiB for
// Llama 3), so few large chunks beat many small ones — 4096 rows for Llama 3 in bf16.
constexpr int64_t kHeadChunkBytes = int64_t{1} << 30;
constexpr int64_t kMinHeadChunkRows = 256;

int64_t head_chunk_rows(int64_t tokens, int64_t vocab, DType dtype) {
  int64_t rows = kMinHeadChunkRows;
  while (rows * 2 * vocab * static_cast<int64_t>(dtype_size(dtype)) <= kHeadChunkBytes) rows *= 2;
  return std::min(tokens, rows);
}

}  // namespace

Transformer::Transformer(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device,
                         DType compute_dtype)
    : config_(config),
      micro_batch_(micro_batch),
      seq_len_(seq_len),
      tokens_(micro_batch * seq_len),
      device_(device),
      compute_dtype_(compute_dtype) {
  config_.validate();
  FORGE_CHECK(micro_batch >= 1 && seq_len >= 1, "micro_batch {} seq_len {}", micro_batch, seq_len);
  const int64_t n = tokens_, h = config.hidden_size, f = config.ffn_hidden_size, d = config.resolved_head_dim();
  const int64_t hq = config.num_heads, hkv = config.num_kv_heads;

  FORGE_CHECK(device == Device::CUDA ? compute_dtype == DType::BF16 : compute_dtype == DType::F32,
              "compute dtype {} on {} (NOTE [Op placement])", dtype_name(compute_dtype), device_name(device));
  rope_tables(rope_cos_, rope_sin_, rope_inv_freq(d, config.rope_theta, config.rope_scaling), seq_len);
  rope_cos_ = rope_cos_.to(device);
  rope_sin_ = rope_sin_.to(device);
  auto act = [&](Shape shape) { return Tensor::empty(std::move(shape), compute_dtype, device); };
  auto stat = [&](Shape shape) { return Tensor::empty(std::move(shape), DType::F32, device); };

  acts_.resize(config.num_layers);
  for (auto& a : acts_) {
    a.input = act({n, h});
    a.rstd_attn = stat({n});
    a.normed_attn = act({n, h});
    a.qkv = act({micro_batch, seq_len, hq + 2 * hkv, d});
    a.attn_out = act({micro_batch, seq_len, hq, d});
    a.lse = stat({micro_batch, hq, seq_len});
    a.mid = act({n, h});
    a.rstd_mlp = stat({n});
    a.normed_mlp = act({n, h});
    a.gate_up = act({n, 2 * f});
    a.swiglu_out = act({n, f});
  }
  final_input_ = act({n, h});
  final_rstd_ = stat({n});
  final_normed_ = act({n, h});
  logits_chunk_ = act({head_chunk_rows(n, config.vocab_size, compute_dtype), config.vocab_size});
  losses_ = stat({n});

  d_residual_ = act({n, h});
  d_normed_ = act({n, h});
  d_attn_out_ = act({n, hq * d});
  d_qkv_ = act({micro_batch, seq_len, hq + 2 * hkv, d});
  d_swiglu_ = act({n, f});
  d_gate_up_ = act({n, 2 * f});
}

void Transformer::forward_blocks(const Tensor& tokens, ParamSource& weights) {
  check_shape(tokens, {micro_batch_, seq_len_}, "tokens");
  const int64_t n = tokens_, d = config_.resolved_head_dim();
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads;
  const float eps = static_cast<float>(config_.norm_eps);
  const AttentionShape attention{hq, hkv, config_.sliding_window, 1.0f / std::sqrt(static_cast<float>(d))};

  embedding_forward(acts_[0].input, tokens.view({n}), weights.embedding());
  for (int i = 0; i < config_.num_layers; ++i) {
    const LayerWeights& w = weights.layer(i);
    LayerActivations& a = acts_[i];
    rmsnorm_forward(a.normed_attn, a.rstd_attn, a.input, w.attn_norm, eps);
    matmul(a.qkv.view({n, (hq + 2 * hkv) * d}), a.normed_attn, false, w.qkv, true);
    rope_forward(a.qkv, hq + hkv, rope_cos_, rope_sin_);
    attention_forward(a.attn_out, a.lse, a.qkv, attention);
    a.mid.copy_from(a.input);
    matmul(a.mid, a.attn_out.view({n, hq * d}), false, w.o, true, 1.0f, 1.0f);

    rmsnorm_forward(a.normed_mlp, a.rstd_mlp, a.mid, w.mlp_norm, eps);
    matmul(a.gate_up, a.normed_mlp, false, w.gate_up, true);
    swiglu_forward(a.swiglu_out, a.gate_up);
    const Tensor& next = i + 1 < config_.num_layers ? acts_[i + 1].input : final_input_;
    next.copy_from(a.mid);
    matmul(next, a.swiglu_out, false, w.down, true, 1.0f, 1.0f);
  }
  rmsnorm_forward(final_normed_, final_rstd_, final_input_, weights.final_norm(), eps);
}

LossSum Transformer::output_head(const Tensor& targets, ParamSource& weights, GradSink* grads, float grad_scale) {
  check_shape(targets, {micro_batch_, seq_len_}, "targets");
  const int64_t n = tokens_;
  const Tensor flat_targets = targets.view({n});
  const Tensor& w_out = weights.output();
  if (grads) d_normed_.fill_zero();
  const int64_t chunk_rows = logits_chunk_.dim(0);
  for (int64_t begin = 0; begin < n; begin += chunk_rows) {
    int64_t end = std::min(n, begin + chunk_rows);
    Tensor logits = logits_chunk_.narrow(0, end - begin);
    Tensor x = final_normed_.narrow(begin, end);
    matmul(logits, x, false, w_out, true);
    cross_entropy_forward_backward(losses_.narrow(begin, end), grads ? logits : Tensor(), logits,
                                   flat_targets.narrow(begin, end), kIgnoreIndex, grad_scale);
    if (grads) {
      matmul(d_normed_.narrow(begin, end), logits, false, w_out, false);
      matmul(grads->output_grad(), logits, true, x, false, 1.0f, 1.0f);
    }
  }
  LossSum loss;
  const Tensor host_losses = losses_.to(Device::CPU), host_targets = flat_targets.to(Device::CPU);
  const float* l = host_losses.data<float>();
  const int32_t* t = host_targets.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == kIgnoreIndex) continue;
    loss.sum += l[i];
    ++loss.tokens;
  }
  return loss;
}

void Transformer::backward_blocks(const Tensor& tokens, ParamSource& weights, GradSink& grads) {
  const int64_t n = tokens_, d = config_.resolved_head_dim();
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads;
  const AttentionShape attention{hq, hkv, config_.sliding_window, 1.0f / std::sqrt(static_cast<float>(d))};

  d_residual_.fill_zero();
  rmsnorm_backward(d_residual_, grads.final_norm_grad(), d_normed_, final_input_, weights.final_norm(), final_rstd_);
  for (int i = config_.num_layers - 1; i >= 0; --i) {
    const LayerWeights& w = weights.layer(i);
    const LayerWeights& g = grads.layer_grads(i);
    LayerActivations& a = acts_[i];
    // next = mid + swiglu_out @ down^T
    matmul(d_swiglu_, d_residual_, false, w.down, false);
    matmul(g.down, d_residual_, true, a.swiglu_out, false, 1.0f, 1.0f);
    swiglu_backward(d_gate_up_, d_swiglu_, a.gate_up);
    matmul(d_normed_, d_gate_up_, false, w.gate_up, false);
    matmul(g.gate_up, d_gate_up_, true, a.normed_mlp, false, 1.0f, 1.0f);
    rmsnorm_backward(d_residual_, g.mlp_norm, d_normed_, a.mid, w.mlp_norm, a.rstd_mlp);
    // mid = input + attn_out @ o^T
    matmul(d_attn_out_, d_residual_, false, w.o, false);
    matmul(g.o, d_residual_, true, a.attn_out.view({n, hq * d}), false, 1.0f, 1.0f);
    attention_backward(d_qkv_, d_attn_out_.view({micro_batch_, seq_len_, hq, d}), a.qkv, a.attn_out, a.lse,
                       attention);
    rope_backward(d_qkv_, hq + hkv, rope_cos_, rope_sin_);
    const Tensor d_qkv_2d = d_qkv_.view({n, (hq + 2 * hkv) * d});
    matmul(d_normed_, d_qkv_2d, false, w.qkv, false);
    matmul(g.qkv, d_qkv_2d, true, a.normed_attn, false, 1.0f, 1.0f);
    rmsnorm_backward(d_residual_, g.attn_norm, d_normed_, a.input, w.attn_norm, a.rstd_attn);
    grads.layer_done(i);
  }
  embedding_backward(grads.embedding_grad(), d_residual_, tokens.view({n}));
}

LossSum Transformer::forward_backward(const Tensor& tokens, const Tensor& targets, ParamSource& weights,
                                      GradSink& grads, float grad_scale) {
  forward_blocks(tokens, weights);
  LossSum loss = output_head(targets, weights, &grads, grad_scale);
  backward_blocks(tokens, weights, grads);
  return loss;
}

LossSum Transformer::forward_loss(const Tensor& tokens, const Tensor& targets, ParamSource& weights) {
  forward_blocks(tokens, weights);
  return output_head(targets, weights, nullptr, 0.0f);
}

void Transformer::forward_logits(const Tensor& tokens, ParamSource& weights, const Tensor& logits) {
  check_shape(logits, {tokens_, config_.vocab_size}, "logits");
  check_dtype(logits, compute_dtype_, "logits");
  forward_blocks(tokens, weights);
  matmul(logits, final_normed_, false, weights.output(), true);
}

}  // namespace forge
