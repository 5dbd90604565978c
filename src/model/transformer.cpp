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
// NOTE [Chunked output head]
// The output projection and cross-entropy run over chunks of tokens: logits for one chunk
// are computed, turned into loss and (in training) into dlogits in place, and immediately
// pushed back through the projection (dx, dW). Only one chunk of logits ever exists: for
// Llama 3 (vocab 128256) at 8192 tokens full fp32 logits would take 4 GiB. A chunk holds
// as many rows as fit in 2 GiB (a power of two, at least 256; head_chunk_rows in
// activations.cpp): the weight-gradient GEMM of every chunk reads and writes the whole
// fp32 dW (2 GiB for Llama 3), so few large chunks beat many small ones — 8192 rows for
// Llama 3 in bf16, whose 2 GiB of logits replace the 4 GiB fp32 ones.

Transformer::Transformer(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device,
                         DType compute_dtype, ActivationCheckpoint checkpoint)
    : config_(config),
      micro_batch_(micro_batch),
      seq_len_(seq_len),
      tokens_(micro_batch * seq_len),
      device_(device),
      compute_dtype_(compute_dtype),
      checkpoint_(checkpoint) {
  config_.validate();
  FORGE_CHECK(micro_batch >= 1 && seq_len >= 1, "micro_batch {} seq_len {}", micro_batch, seq_len);
  FORGE_CHECK(device == Device::CUDA ? compute_dtype == DType::BF16 : compute_dtype == DType::F32,
              "compute dtype {} on {} (NOTE [Op placement])", dtype_name(compute_dtype), device_name(device));
  rope_tables(rope_cos_, rope_sin_, rope_inv_freq(config.resolved_head_dim(), config.rope_theta, config.rope_scaling),
              seq_len);
  rope_cos_ = rope_cos_.to(device);
  rope_sin_ = rope_sin_.to(device);
  arena_ = Tensor::empty({activation_bytes(config_, micro_batch, seq_len, compute_dtype, checkpoint)}, DType::U8,
                         device);
  ArenaLayout layout(arena_.raw(), device);
  lay_out_activations(b_, config_, micro_batch, seq_len, compute_dtype, checkpoint, layout);
}

void Transformer::forward_layer(int i, ParamSource& weights, const Tensor* next) {
  const int64_t n = tokens_, d = config_.resolved_head_dim();
  const int64_t hq = config_.num_heads, hkv = config_.num_kv_heads;
  const float eps = static_cast<float>(config_.norm_eps);
  const AttentionShape attention{hq, hkv, config_.sliding_window, 1.0f / std::sqrt(static_cast<float>(d))};
  const LayerWeights& w = weights.layer(i);
  LayerActivations& a = b_.layers[i];
  rmsnorm_forward(a.normed_attn, a.rstd_attn, a.input, w.attn_norm, eps);
  matmul(a.qkv.view({n, (hq + 2 * hkv) * d}), a.normed_attn, false, w.qkv, true);
  rope_forward(a.qkv, hq + hkv, rope_cos_, rope_sin_);
  attention_forward(a.attn_out, a.lse, a.qkv, attention);
  matmul_add(a.mid, a.attn_out.view({n, hq * d}), false, w.o, true, a.input);

  rmsnorm_forward(a.normed_mlp, a.rstd_mlp, a.mid, w.mlp_norm, eps);
  matmul(a.gate_up, a.normed_mlp, false, w.gate_up, true);
  swiglu_forward(a.swiglu_out, a.gate_up);
  if (!next) return;
  matmul_add(*next, a.swiglu_out, false, w.down, true, a.mid);
}

void Transformer::forward_blocks(const Tensor& tokens, ParamSource& weights) {
  check_shape(tokens, {micro_batch_, seq_len_}, "tokens");
  embedding_forward(b_.layers[0].input, tokens.view({tokens_}), weights.embedding());
  for (int i = 0; i < config_.num_layers; ++i)
    forward_layer(i, weights, i + 1 < config_.num_layers ? &b_.layers[i + 1].input : &b_.final_input);
  rmsnorm_forward(b_.final_normed, b_.final_rstd, b_.final_input, weights.final_norm(),
                  static_cast<float>(config_.norm_eps));
}

void Transformer::recompute_layer(int i, ParamSource& weights) {
  switch (checkpoint_) {
    case ActivationCheckpoint::None: return;
    case ActivationCheckpoint::Full: return forward_layer(i, weights, nullptr);
    case ActivationCheckpoint::Selective: {
      const LayerWeights& w = weights.layer(i);
      LayerActivations& a = b_.layers[i];
      const float eps = static_cast<float>(config_.norm_eps);
      rmsnorm_forward(a.normed_attn, a.rstd_attn, a.input, w.attn_norm, eps);
      rmsnorm_forward(a.normed_mlp, a.rstd_mlp, a.mid, w.mlp_norm, eps);
      swiglu_forward(a.swiglu_out, a.gate_up);
      return;
    }
  }
}

LossSum Transformer::output_head(const Tensor& targets, ParamSource& weights, GradSink* grads, float grad_scale) {
  check_shape(targets, {micro_batch_, seq_len_}, "targets");
  const int64_t n = tokens_;
  const Tensor flat_targets = targets.view({n});
  const Tensor& w_out = weights.output();
  // NOTE [Fresh gradient buffers]: a tied output's gradient is the embedding's.
  bool overwrite = false;
  if (grads) {
    grads->output_grad();  // hands the buffer out before asking whether it is fresh
    overwrite = config_.tie_word_embeddings ? grads->embedding_grad_fresh() : grads->head_grads_fresh();
  }
  const int64_t chunk_rows = b_.logits_chunk.dim(0);
  for (int64_t begin = 0; begin < n; begin += chunk_rows) {
    int64_t end = std::min(n, begin + chunk_rows);
    Tensor logits = b_.logits_chunk.narrow(0, end - begin);
    Tensor x = b_.final_normed.narrow(begin, end);
    matmul(logits, x, false, w_out, true);
    cross_entropy_forward_backward(b_.losses.narrow(begin, end), grads ? logits : Tensor(), logits,
                                   flat_targets.narrow(begin, end), kIgnoreIndex, grad_scale);
    if (grads) {
      matmul(b_.d_normed.narrow(begin, end), logits, false, w_out, false);
      matmul(grads->output_grad(), logits, true, x, false, 1.0f, overwrite && begin == 0 ? 0.0f : 1.0f);
    }
  }
  LossSum loss;
  const Tensor host_losses = b_.losses.to(Device::CPU), host_targets = flat_targets.to(Device::CPU);
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

  b_.d_residual.fill_zero();
  const Tensor& final_norm_grad = grads.final_norm_grad();
  if (grads.head_grads_fresh()) final_norm_grad.fill_zero();  // the norm's backward adds
  rmsnorm_backward(b_.d_residual, final_norm_grad, b_.d_normed, b_.final_input, weights.final_norm(), b_.final_rstd);
  grads.head_done();
  for (int i = config_.num_layers - 1; i >= 0; --i) {
    const LayerWeights& w = weights.layer(i);
    const LayerWeights& g = grads.layer_grads(i);
    // Weight gradients: written over a fresh buffer, added to one that holds earlier
    // micro-batches' (NOTE [Fresh gradient buffers]).
    const bool fresh = grads.layer_grads_fresh(i);
    const float beta = fresh ? 0.0f : 1.0f;
    if (fresh) {
      g.mlp_norm.fill_zero();
      g.attn_norm.fill_zero();
    }
    recompute_layer(i, weights);
    LayerActivations& a = b_.layers[i];
    // next = mid + swiglu_out @ down^T
    matmul(b_.d_swiglu, b_.d_residual, false, w.down, false);
    matmul(g.down, b_.d_residual, true, a.swiglu_out, false, 1.0f, beta);
    swiglu_backward(b_.d_gate_up, b_.d_swiglu, a.gate_up);
    matmul(b_.d_normed, b_.d_gate_up, false, w.gate_up, false);
    matmul(g.gate_up, b_.d_gate_up, true, a.normed_mlp, false, 1.0f, beta);
    rmsnorm_backward(b_.d_residual, g.mlp_norm, b_.d_normed, a.mid, w.mlp_norm, a.rstd_mlp);
    // mid = input + attn_out @ o^T
    matmul(b_.d_attn_out, b_.d_residual, false, w.o, false);
    matmul(g.o, b_.d_residual, true, a.attn_out.view({n, hq * d}), false, 1.0f, beta);
    attention_backward(b_.d_qkv, b_.d_attn_out.view({micro_batch_, seq_len_, hq, d}), a.qkv, a.attn_out, a.lse,
                       attention);
    rope_backward(b_.d_qkv, hq + hkv, rope_cos_, rope_sin_);
    const Tensor d_qkv_2d = b_.d_qkv.view({n, (hq + 2 * hkv) * d});
    matmul(b_.d_normed, d_qkv_2d, false, w.qkv, false);
    matmul(g.qkv, d_qkv_2d, true, a.normed_attn, false, 1.0f, beta);
    rmsnorm_backward(b_.d_residual, g.attn_norm, b_.d_normed, a.input, w.attn_norm, a.rstd_attn);
    grads.layer_done(i);
  }
  const Tensor& embedding_grad = grads.embedding_grad();
  if (grads.embedding_grad_fresh()) embedding_grad.fill_zero();  // the scatter-add only touches the batch's tokens
  embedding_backward(embedding_grad, b_.d_residual, tokens.view({n}));
  grads.embedding_done();
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
  matmul(logits, b_.final_normed, false, weights.output(), true);
}

}  // namespace forge
