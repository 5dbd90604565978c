#include "model/incremental_decoder.h"

#include <cmath>

#include "model/moe_feed_forward.h"
#include "model/self_attention.h"
#include "model/swiglu_feed_forward.h"
#include "ops/decode_attention.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace forge {
namespace {

// Self-attention's parameters in its param_specs order (self_attention.h).
enum AttentionParam : size_t { kAttentionNorm, kQkv, kOut, kAttentionParams };

}  // namespace

IncrementalDecoder::IncrementalDecoder(const ModelConfig& config, int64_t capacity, Device device,
                                       DType compute_dtype)
    : config_(config),
      capacity_(capacity),
      device_(device),
      dtype_(compute_dtype),
      hidden_(config.hidden_size),
      heads_(config.num_heads),
      kv_heads_(config.num_kv_heads),
      head_dim_(config.resolved_head_dim()),
      eps_(static_cast<float>(config.norm_eps)),
      attention_{config.num_heads, config.num_kv_heads, config.sliding_window,
                 1.0f / std::sqrt(static_cast<float>(config.resolved_head_dim()))} {
  config_.validate();
  FORGE_CHECK(capacity >= 1, "a KV cache of {} positions", capacity);
  FORGE_CHECK(device == Device::CUDA ? compute_dtype == DType::BF16 : compute_dtype == DType::F32,
              "compute dtype {} on {} (NOTE [Op placement])", dtype_name(compute_dtype), device_name(device));
  components_ = make_block_components(config_);
  first_param_.push_back(0);
  for (const auto& component : components_) {
    const std::vector<ParamSpec> specs = component->param_specs(0);
    if (dynamic_cast<const SelfAttention*>(component.get())) {
      FORGE_CHECK(specs.size() == kAttentionParams && specs[kAttentionNorm].name.ends_with("attn_norm.weight") &&
                      specs[kQkv].name.ends_with("attention.qkv.weight") &&
                      specs[kOut].name.ends_with("attention.o.weight"),
                  "self-attention's parameters are not the norm, qkv and o the KV-cache decoder reads");
      is_attention_.push_back(true);
    } else if (dynamic_cast<const SwiGluFeedForward*>(component.get()) ||
               dynamic_cast<const MoeFeedForward*>(component.get())) {
      is_attention_.push_back(false);  // works on each position alone
    } else {
      FORGE_FAIL("incremental decoding (NOTE [Incremental decoding]) does not know the block component declaring '{}'",
                 specs.empty() ? std::string("no parameters") : specs.front().name);
    }
    first_param_.push_back(first_param_.back() + specs.size());
  }
  rope_tables(rope_cos_, rope_sin_, rope_inv_freq(head_dim_, config_.rope_theta, config_.rope_scaling), capacity,
              rope_attention_factor(config_.rope_scaling));
  rope_cos_ = rope_cos_.to(device);
  rope_sin_ = rope_sin_.to(device);
  for (int i = 0; i < config_.num_layers; ++i) {
    k_cache_.push_back(Tensor::empty({1, capacity, kv_heads_, head_dim_}, dtype_, device));
    v_cache_.push_back(Tensor::empty({1, capacity, kv_heads_, head_dim_}, dtype_, device));
  }
}

void IncrementalDecoder::lay_out_step(int64_t tokens) {
  if (tokens == step_tokens_) return;
  const StepShape shape{1, tokens, dtype_};
  const int64_t n = tokens;
  auto lay_out = [&](ArenaLayout& layout) {
    auto act = [&](Shape s) { return layout.take(std::move(s), dtype_); };
    stream_[0] = act({n, hidden_});
    stream_[1] = act({n, hidden_});
    normed_ = act({n, hidden_});
    rstd_ = layout.take({n}, DType::F32);
    qkv_ = act({1, n, heads_ + 2 * kv_heads_, head_dim_});
    attention_out_ = act({1, n, heads_, head_dim_});
    final_normed_ = act({n, hidden_});
    final_rstd_ = layout.take({n}, DType::F32);
    for (size_t c = 0; c < components_.size(); ++c)
      if (!is_attention_[c]) components_[c]->lay_out(layout, shape, ActivationCheckpoint::Full, config_.num_layers);
  };
  ArenaLayout counting(nullptr, device_);
  lay_out(counting);
  arena_ = Tensor();
  arena_ = Tensor::empty({counting.bytes()}, DType::U8, device_);
  ArenaLayout layout(arena_.raw(), device_);
  lay_out(layout);
  for (size_t c = 0; c < components_.size(); ++c)
    if (!is_attention_[c]) components_[c]->prepare(shape, device_);
  step_tokens_ = tokens;
}

void IncrementalDecoder::cached_attention(int layer, const ComponentWeights& w, const Tensor& x, const Tensor& y) {
  const int64_t n = step_tokens_;
  const auto i = static_cast<size_t>(layer);
  rmsnorm_forward(normed_, rstd_, x, w.tensor(kAttentionNorm), eps_);
  linear_forward(qkv_.view({n, (heads_ + 2 * kv_heads_) * head_dim_}), normed_, w.linear(kQkv));
  rope_forward(qkv_, heads_ + kv_heads_, rope_cos_.narrow(position_, position_ + n),
               rope_sin_.narrow(position_, position_ + n));
  kv_cache_append(k_cache_[i], v_cache_[i], qkv_, position_, attention_);
  decode_attention_forward(attention_out_, qkv_, k_cache_[i], v_cache_[i], position_, attention_);
  linear_forward(y, attention_out_.view({n, heads_ * head_dim_}), w.linear(kOut), &x);
}

void IncrementalDecoder::forward(const Tensor& tokens, ParamSource& weights, const Tensor& logits) {
  FORGE_CHECK(tokens.ndim() == 1 && tokens.numel() >= 1, "tokens {} must be [n], n >= 1", shape_str(tokens.shape()));
  FORGE_CHECK(tokens.dtype() == DType::I32 && tokens.device() == device_, "tokens must be int32 on {}",
              device_name(device_));
  const int64_t n = tokens.numel();
  FORGE_CHECK(position_ + n <= capacity_, "positions {} .. {} exceed the KV cache's {} positions", position_,
              position_ + n - 1, capacity_);
  const int64_t rows = logits.ndim() == 2 ? logits.dim(0) : -1;
  FORGE_CHECK(rows >= 0 && rows <= n && logits.dim(1) == config_.vocab_size,
              "logits {} must be [rows <= {}, {}]", shape_str(logits.shape()), n, config_.vocab_size);
  FORGE_CHECK(rows == 0 || (logits.dtype() == dtype_ && logits.device() == device_), "logits must be {} on {}",
              dtype_name(dtype_), device_name(device_));
  lay_out_step(n);
  embedding_forward(stream_[0], tokens, weights.embedding());
  int current = 0;
  for (int i = 0; i < config_.num_layers; ++i) {
    const BlockWeights& block = weights.layer(i);
    FORGE_CHECK(block.params.size() == first_param_.back(), "block {}'s weights hold {} parameters, its components {}",
                i, block.params.size(), first_param_.back());
    for (size_t c = 0; c < components_.size(); ++c) {
      const ComponentWeights w(block, first_param_[c], first_param_[c + 1] - first_param_[c]);
      const Tensor& x = stream_[current];
      const Tensor& y = stream_[1 - current];
      if (is_attention_[c]) {
        cached_attention(i, w, x, y);
      } else {
        components_[c]->forward(i, w, x, &y);
      }
      current = 1 - current;
    }
  }
  if (rows > 0) {
    rmsnorm_forward(final_normed_.narrow(0, rows), final_rstd_.narrow(0, rows), stream_[current].narrow(n - rows, n),
                    weights.final_norm(), eps_);
    linear_forward(logits, final_normed_.narrow(0, rows), weights.output());
  }
  position_ += n;
}

}  // namespace forge
