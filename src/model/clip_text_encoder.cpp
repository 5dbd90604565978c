// CLIP's text encoder; see clip_text_encoder.h (NOTE [CLIP text encoder]).
#include "model/clip_text_encoder.h"

#include <cmath>

#include <fmt/format.h>

#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gelu.h"
#include "ops/layer_norm.h"

namespace forge {
namespace {

constexpr int64_t kTensorAlignment = 64;  // values (NOTE [CLIP text parameters])

int64_t aligned(int64_t offset) { return (offset + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment; }

LinearWeight linear(const Tensor& weight, const Tensor& bias) {
  LinearWeight w;
  w.weight = weight;
  w.bias = bias;
  return w;
}

void activate(ClipActivation activation, const Tensor& out, const Tensor& in) {
  switch (activation) {
    case ClipActivation::QuickGelu: return quick_gelu_forward(out, in);
    case ClipActivation::GeluErf: return gelu_erf_forward(out, in);
    case ClipActivation::GeluTanh: return gelu_tanh_forward(out, in);
  }
}

}  // namespace

std::vector<ClipTextParameterSpec> clip_text_parameter_specs(const ClipTextConfig& c) {
  const int64_t d = c.hidden_size, m = c.intermediate_size;
  std::vector<ClipTextParameterSpec> specs = {{"embeddings.token_embedding.weight", {c.vocab_size, d}},
                                              {"embeddings.position_embedding.weight", {c.max_positions, d}}};
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = fmt::format("encoder.layers.{}.", i);
    specs.push_back({p + "self_attn.q_proj.weight", {d, d}});
    specs.push_back({p + "self_attn.k_proj.weight", {d, d}, true});
    specs.push_back({p + "self_attn.v_proj.weight", {d, d}, true});
    specs.push_back({p + "self_attn.q_proj.bias", {d}});
    specs.push_back({p + "self_attn.k_proj.bias", {d}, true});
    specs.push_back({p + "self_attn.v_proj.bias", {d}, true});
    specs.push_back({p + "self_attn.out_proj.weight", {d, d}});
    specs.push_back({p + "self_attn.out_proj.bias", {d}});
    specs.push_back({p + "layer_norm1.weight", {d}});
    specs.push_back({p + "layer_norm1.bias", {d}});
    specs.push_back({p + "mlp.fc1.weight", {m, d}});
    specs.push_back({p + "mlp.fc1.bias", {m}});
    specs.push_back({p + "mlp.fc2.weight", {d, m}});
    specs.push_back({p + "mlp.fc2.bias", {d}});
    specs.push_back({p + "layer_norm2.weight", {d}});
    specs.push_back({p + "layer_norm2.bias", {d}});
  }
  specs.push_back({"final_layer_norm.weight", {d}});
  specs.push_back({"final_layer_norm.bias", {d}});
  return specs;
}

ClipTextParameters::ClipTextParameters(const ClipTextConfig& config, Device device, DType dtype)
    : config_(config), specs_(clip_text_parameter_specs(config)) {
  config_.validate(config_.name);
  FORGE_CHECK(dtype == DType::F32 || (device == Device::CUDA && dtype == DType::BF16),
              "CLIP text parameters are fp32 on the CPU and bf16 or fp32 on CUDA, not {} on {}", dtype_name(dtype),
              device_name(device));
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (const ClipTextParameterSpec& s : specs_) {
    if (!s.follows_previous) offset = aligned(offset);
    offsets.push_back(offset);
    offset += shape_numel(s.shape);
  }
  flat_ = Tensor::zeros({aligned(offset)}, dtype, device);
  for (size_t i = 0; i < specs_.size(); ++i) {
    const int64_t n = shape_numel(specs_[i].shape);
    tensors_.push_back(flat_.narrow(offsets[i], offsets[i] + n).view(specs_[i].shape));
  }
  // The fused QKV of a layer spans its q, k and v tensors (NOTE [CLIP text parameters]).
  auto fused = [&](size_t q, int64_t rows_per_part) {
    const Tensor& first = tensors_[q];
    const int64_t n = 3 * first.numel();
    Shape shape = first.shape();
    shape[0] = 3 * rows_per_part;
    return flat_.narrow(offsets[q], offsets[q] + n).view(shape);
  };
  token_embedding_ = tensors_[0];
  position_embedding_ = tensors_[1];
  constexpr size_t kPerLayer = 16;
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const size_t b = 2 + static_cast<size_t>(i) * kPerLayer;
    Layer l;
    l.qkv = linear(fused(b, config_.hidden_size), fused(b + 3, config_.hidden_size));
    l.out = linear(tensors_[b + 6], tensors_[b + 7]);
    l.norm1_weight = tensors_[b + 8];
    l.norm1_bias = tensors_[b + 9];
    l.fc1 = linear(tensors_[b + 10], tensors_[b + 11]);
    l.fc2 = linear(tensors_[b + 12], tensors_[b + 13]);
    l.norm2_weight = tensors_[b + 14];
    l.norm2_bias = tensors_[b + 15];
    layers_.push_back(std::move(l));
  }
  final_norm_weight_ = tensors_[tensors_.size() - 2];
  final_norm_bias_ = tensors_.back();
}

const Tensor& ClipTextParameters::tensor(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return tensors_[i];
  FORGE_FAIL("the CLIP text encoder has no parameter '{}'", name);
}

void ClipTextParameters::assign_from(const ClipTextParameters& other) {
  FORGE_CHECK(other.flat_.numel() == flat_.numel(), "assign_from: {} CLIP text values into {}", other.flat_.numel(),
              flat_.numel());
  if (other.flat_.device() == flat_.device())
    cast(flat_, other.flat_);
  else
    cast(flat_, other.flat_.to(flat_.device()));
}

std::vector<int64_t> clip_pooled_positions(const ClipTextConfig& config, const std::vector<int32_t>& tokens,
                                           int64_t batch, int64_t seq) {
  FORGE_CHECK(batch >= 0 && seq > 0 && static_cast<int64_t>(tokens.size()) == batch * seq,
              "clip_pooled_positions: {} token ids for {} captions of {} tokens", tokens.size(), batch, seq);
  std::vector<int64_t> positions(static_cast<size_t>(batch), 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* row = tokens.data() + b * seq;
    int64_t& pick = positions[static_cast<size_t>(b)];
    for (int64_t t = 0; t < seq; ++t) {
      if (config.legacy_pooling() ? row[t] > row[pick] : row[t] == config.eos_token_id) {
        pick = t;
        if (!config.legacy_pooling()) break;
      }
    }
  }
  return positions;
}

ClipTextEncoder::ClipTextEncoder(const ClipTextConfig& config, int64_t batch, int64_t seq, Device device)
    : config_(config), batch_(batch), seq_(seq), device_(device),
      dtype_(device == Device::CUDA ? DType::BF16 : DType::F32) {
  config_.validate(config_.name);
  FORGE_CHECK(batch > 0, "CLIP text encoder: the batch must hold at least one caption, got {}", batch);
  FORGE_CHECK(seq > 0 && seq <= config.max_positions,
              "CLIP text encoder: {} tokens per caption, the model has positions for 1 to {}", seq,
              config.max_positions);
  const int64_t n = batch * seq, d = config.hidden_size, h = config.num_heads;
  ids_ = Tensor::empty({n}, DType::I32, device);
  positions_ = Tensor::empty({n}, DType::I32, device);
  h_ = Tensor::empty({n, d}, dtype_, device);
  normed_ = Tensor::empty({n, d}, dtype_, device);
  embedded_ = Tensor::empty({n, d}, dtype_, device);
  qkv_ = Tensor::empty({batch, seq, 3 * h, config.head_dim()}, dtype_, device);
  attention_ = Tensor::empty({batch, seq, h, config.head_dim()}, dtype_, device);
  lse_ = Tensor::empty({batch, h, seq}, DType::F32, device);
  mlp_ = Tensor::empty({n, config.intermediate_size}, dtype_, device);
  activated_ = Tensor::empty({n, config.intermediate_size}, dtype_, device);
  Tensor positions = Tensor::empty({n}, DType::I32);
  for (int64_t i = 0; i < n; ++i) positions.data<int32_t>()[i] = static_cast<int32_t>(i % seq);
  positions_.copy_from(positions);
}

void ClipTextEncoder::forward(const std::vector<int32_t>& tokens, const ClipTextParameters& params,
                              const Tensor& last_hidden, const Tensor& pooled) {
  const ClipTextConfig& c = params.config();
  FORGE_CHECK(c.hidden_size == config_.hidden_size && c.num_layers == config_.num_layers &&
                  c.num_heads == config_.num_heads && c.intermediate_size == config_.intermediate_size &&
                  c.vocab_size == config_.vocab_size && c.max_positions == config_.max_positions,
              "CLIP text encoder: the parameters are of another model ({}) than the encoder's ({})", c.name,
              config_.name);
  const int64_t n = batch_ * seq_, d = config_.hidden_size;
  FORGE_CHECK(static_cast<int64_t>(tokens.size()) == n, "CLIP text encoder: {} token ids for {} captions of {} tokens",
              tokens.size(), batch_, seq_);
  for (int64_t i = 0; i < n; ++i)
    FORGE_CHECK(tokens[i] >= 0 && tokens[i] < config_.vocab_size,
                "CLIP text encoder: token id {} (caption {}, position {}) is outside the vocabulary [0, {})", tokens[i],
                i / seq_, i % seq_, config_.vocab_size);
  check_shape(last_hidden, {batch_, seq_, d}, "CLIP text encoder last_hidden");
  check_shape(pooled, {batch_, d}, "CLIP text encoder pooled");
  FORGE_CHECK(last_hidden.device() == device_ && pooled.device() == device_ && last_hidden.dtype() == dtype_ &&
                  pooled.dtype() == dtype_ && params.token_embedding().device() == device_ &&
                  params.token_embedding().dtype() == dtype_,
              "CLIP text encoder: the outputs and parameters must be {} on {}", dtype_name(dtype_),
              device_name(device_));

  ids_.copy_from(Tensor::wrap(const_cast<int32_t*>(tokens.data()), {n}, DType::I32));
  embedding_forward(h_, ids_, params.token_embedding());
  embedding_forward(embedded_, positions_, params.position_embedding());
  accumulate(h_, embedded_);

  AttentionShape shape;
  shape.num_q_heads = config_.num_heads;
  shape.num_kv_heads = config_.num_heads;
  shape.head_dim = config_.head_dim();
  shape.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(config_.head_dim())));
  shape.causal = true;
  const float eps = static_cast<float>(config_.layer_norm_eps);
  const Tensor qkv_rows = qkv_.view({n, 3 * d}), attention_rows = attention_.view({n, d});
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const ClipTextParameters::Layer& l = params.layer(i);
    layer_norm_forward(normed_, h_, l.norm1_weight, l.norm1_bias, eps);
    linear_forward(qkv_rows, normed_, l.qkv);
    attention_forward(attention_, lse_, qkv_, shape);
    linear_forward(h_, attention_rows, l.out, &h_);
    layer_norm_forward(normed_, h_, l.norm2_weight, l.norm2_bias, eps);
    linear_forward(mlp_, normed_, l.fc1);
    activate(config_.activation, activated_, mlp_);
    linear_forward(h_, activated_, l.fc2, &h_);
  }
  const Tensor hidden_rows = last_hidden.view({n, d});
  layer_norm_forward(hidden_rows, h_, params.final_norm_weight(), params.final_norm_bias(), eps);
  const std::vector<int64_t> picks = clip_pooled_positions(config_, tokens, batch_, seq_);
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t row = b * seq_ + picks[static_cast<size_t>(b)];
    pooled.narrow(b, b + 1).copy_from(hidden_rows.narrow(row, row + 1));
  }
}

}  // namespace forge
