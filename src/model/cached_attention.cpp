#include "model/cached_attention.h"

#include <cmath>
#include <vector>

#include "model/latent_attention.h"
#include "model/self_attention.h"
#include "ops/attention.h"
#include "ops/decode_attention.h"
#include "ops/latent_attention.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace forge {
namespace {

// Checks that a component declares the parameters, in order, whose names end as
// `expected`.
void expect_params(const BlockComponent &component,
                   const std::vector<const char *> &expected,
                   const char *kind) {
  const std::vector<ParamSpec> specs = component.param_specs(0);
  bool same = specs.size() == expected.size();
  for (size_t i = 0; same && i < specs.size(); ++i)
    same = specs[i].name.ends_with(expected[i]);
  FORGE_CHECK(same,
              "{}'s parameters are not the ones its KV-cache decoding reads",
              kind);
}

// Rotary tables for positions 0 .. capacity - 1, on the device.
void device_rope_tables(Tensor &cos, Tensor &sin, int64_t rotary_dim,
                        const ModelConfig &config, int64_t capacity,
                        Device device) {
  rope_tables(cos, sin,
              rope_inv_freq(rotary_dim, config.rope_theta, config.rope_scaling),
              capacity, rope_attention_factor(config.rope_scaling));
  cos = cos.to(device);
  sin = sin.to(device);
}

class CachedSelfAttention final : public CachedAttention {
public:
  // Self-attention's parameters in its param_specs order (self_attention.h).
  enum Param : size_t { kNorm, kQkv, kOut };

  CachedSelfAttention(const ModelConfig &config, int64_t capacity,
                      Device device, DType dtype)
      : hidden_(config.hidden_size), heads_(config.num_heads),
        kv_heads_(config.num_kv_heads), head_dim_(config.resolved_head_dim()),
        eps_(static_cast<float>(config.norm_eps)),
        dtype_(dtype), shape_{config.num_heads, config.num_kv_heads,
                              config.sliding_window,
                              1.0f / std::sqrt(static_cast<float>(
                                         config.resolved_head_dim()))} {
    device_rope_tables(cos_, sin_, head_dim_, config, capacity, device);
    for (int i = 0; i < config.num_layers; ++i) {
      k_cache_.push_back(
          Tensor::empty({1, capacity, kv_heads_, head_dim_}, dtype, device));
      v_cache_.push_back(
          Tensor::empty({1, capacity, kv_heads_, head_dim_}, dtype, device));
    }
  }

  void lay_out(ArenaLayout &layout, int64_t n) override {
    n_ = n;
    normed_ = layout.take({n, hidden_}, dtype_);
    rstd_ = layout.take({n}, DType::F32);
    qkv_ = layout.take({1, n, heads_ + 2 * kv_heads_, head_dim_}, dtype_);
    out_ = layout.take({1, n, heads_, head_dim_}, dtype_);
  }

  void forward(int layer, const ComponentWeights &w, const Tensor &x,
               const Tensor &y, int64_t position) override {
    const auto i = static_cast<size_t>(layer);
    rmsnorm_forward(normed_, rstd_, x, w.tensor(kNorm), eps_);
    linear_forward(qkv_.view({n_, (heads_ + 2 * kv_heads_) * head_dim_}),
                   normed_, w.linear(kQkv));
    rope_forward(qkv_, heads_ + kv_heads_, cos_.narrow(position, position + n_),
                 sin_.narrow(position, position + n_));
    kv_cache_append(k_cache_[i], v_cache_[i], qkv_, position, shape_);
    decode_attention_forward(out_, qkv_, k_cache_[i], v_cache_[i], position,
                             shape_);
    linear_forward(y, out_.view({n_, heads_ * head_dim_}), w.linear(kOut), &x);
  }

private:
  int64_t hidden_, heads_, kv_heads_, head_dim_;
  float eps_;
  DType dtype_;
  AttentionShape shape_;
  Tensor cos_, sin_; // [capacity, head_dim / 2], fp32
  std::vector<Tensor> k_cache_,
      v_cache_; // per layer [1, capacity, kv_heads, head_dim]
  int64_t n_ = 0;
  Tensor normed_, rstd_, qkv_, out_;
};

class CachedLatentAttention final : public CachedAttention {
public:
  CachedLatentAttention(const ModelConfig &config, int64_t capacity,
                        Device device, DType dtype)
      : hidden_(config.hidden_size), q_rank_(config.q_lora_rank),
        kv_rank_(config.kv_lora_rank), dims_{config.num_heads,
                                             config.qk_nope_head_dim,
                                             config.qk_rope_head_dim,
                                             config.v_head_dim, 0},
        eps_(static_cast<float>(config.norm_eps)), dtype_(dtype) {
    // LatentAttention's shape and parameter order (latent_attention.h).
    shape_.num_q_heads = shape_.num_kv_heads = dims_.heads;
    shape_.scale = static_cast<float>(
        rope_softmax_scale(config.rope_scaling) /
        std::sqrt(static_cast<double>(config.qk_head_dim())));
    shape_.head_dim = dims_.qk_dim();
    shape_.v_head_dim = dims_.v_dim;
    size_t next = 1; // 0: the attention norm
    if (q_rank_ > 0) {
      q_a_ = next++;
      q_a_norm_ = next++;
      q_b_ = next++;
    } else {
      q_ = next++;
    }
    kv_a_ = next++;
    kv_a_norm_ = next++;
    kv_b_ = next++;
    out_param_ = next++;
    device_rope_tables(cos_, sin_, dims_.rope_dim, config, capacity, device);
    for (int i = 0; i < config.num_layers; ++i) {
      k_cache_.push_back(Tensor::empty(
          {1, capacity, dims_.heads, dims_.qk_dim()}, dtype, device));
      v_cache_.push_back(Tensor::empty({1, capacity, dims_.heads, dims_.v_dim},
                                       dtype, device));
    }
  }

  void lay_out(ArenaLayout &layout, int64_t n) override {
    n_ = n;
    auto act = [&](Shape s) { return layout.take(std::move(s), dtype_); };
    normed_ = act({n, hidden_});
    rstd_ = layout.take({n}, DType::F32);
    if (q_rank_ > 0) {
      q_a_out_ = act({n, q_rank_});
      q_compressed_ = act({n, q_rank_});
    }
    q_out_ = act({n, dims_.heads * dims_.qk_dim()});
    kv_a_out_ = act({n, kv_rank_});
    kv_compressed_ = act({n, kv_rank_});
    k_pe_ = act({n, dims_.rope_dim});
    kv_ = act({n, dims_.heads * (dims_.nope_dim + dims_.v_dim)});
    qkv_ = act({1, n, dims_.packed_width()});
    out_ = act({1, n, dims_.heads, dims_.v_dim});
  }

  void forward(int layer, const ComponentWeights &w, const Tensor &x,
               const Tensor &y, int64_t position) override {
    const auto i = static_cast<size_t>(layer);
    rmsnorm_forward(normed_, rstd_, x, w.tensor(0), eps_);
    if (q_rank_ > 0) {
      linear_forward(q_a_out_, normed_, w.linear(q_a_));
      rmsnorm_forward(q_compressed_, rstd_, q_a_out_, w.tensor(q_a_norm_),
                      eps_);
      linear_forward(q_out_, q_compressed_, w.linear(q_b_));
    } else {
      linear_forward(q_out_, normed_, w.linear(q_));
    }
    // kv_a's rows: the compressed kv, then k_pe (NOTE [Multi-head Latent
    // Attention]).
    const Tensor &kv_a = w.tensor(kv_a_);
    auto rows = [&](int64_t begin, int64_t end) {
      return LinearWeight{
          kv_a.narrow(begin, end).view({end - begin, kv_a.dim(1)})};
    };
    linear_forward(kv_a_out_, normed_, rows(0, kv_rank_));
    linear_forward(k_pe_, normed_, rows(kv_rank_, kv_rank_ + dims_.rope_dim));
    rmsnorm_forward(kv_compressed_, rstd_, kv_a_out_, w.tensor(kv_a_norm_),
                    eps_);
    linear_forward(kv_, kv_compressed_, w.linear(kv_b_));
    // The tables narrowed to the step's positions: token t of the step sits at
    // position + t.
    mla_pack_qkv(qkv_, q_out_, k_pe_, kv_, dims_,
                 cos_.narrow(position, position + n_),
                 sin_.narrow(position, position + n_));
    // The attention op's form of the packed rows (NOTE [Value head dim]): 4-D
    // when the values' head dim equals the queries'.
    const Tensor rows_for_attention = qkv_.view(shape_.qkv_shape(1, n_));
    kv_cache_append(k_cache_[i], v_cache_[i], rows_for_attention, position,
                    shape_);
    decode_attention_forward(out_, rows_for_attention, k_cache_[i], v_cache_[i],
                             position, shape_);
    linear_forward(y, out_.view({n_, dims_.heads * dims_.v_dim}),
                   w.linear(out_param_), &x);
  }

private:
  int64_t hidden_, q_rank_, kv_rank_;
  MlaDims dims_; // kv_rank 0: k_pe is handed to the packing on its own
  float eps_;
  DType dtype_;
  AttentionShape shape_;
  size_t q_ = 0, q_a_ = 0, q_a_norm_ = 0, q_b_ = 0, kv_a_ = 0, kv_a_norm_ = 0,
         kv_b_ = 0, out_param_ = 0;
  Tensor cos_, sin_; // [capacity, rope_dim / 2], fp32
  std::vector<Tensor> k_cache_,
      v_cache_; // per layer [1, capacity, H, dn + dr] and [1, capacity, H, dv]
  int64_t n_ = 0;
  Tensor normed_, rstd_, q_a_out_, q_compressed_, q_out_, kv_a_out_,
      kv_compressed_, k_pe_, kv_, qkv_, out_;
};

} // namespace

std::unique_ptr<CachedAttention>
make_cached_attention(const BlockComponent &component,
                      const ModelConfig &config, int64_t capacity,
                      Device device, DType dtype) {
  if (dynamic_cast<const SelfAttention *>(&component)) {
    expect_params(
        component,
        {"attn_norm.weight", "attention.qkv.weight", "attention.o.weight"},
        "self-attention");
    return std::make_unique<CachedSelfAttention>(config, capacity, device,
                                                 dtype);
  }
  if (dynamic_cast<const LatentAttention *>(&component)) {
    if (config.q_lora_rank > 0)
      expect_params(component,
                    {"attn_norm.weight", "attention.q_a.weight",
                     "attention.q_a_norm.weight", "attention.q_b.weight",
                     "attention.kv_a.weight", "attention.kv_a_norm.weight",
                     "attention.kv_b.weight", "attention.o.weight"},
                    "multi-head latent attention");
    else
      expect_params(component,
                    {"attn_norm.weight", "attention.q.weight",
                     "attention.kv_a.weight", "attention.kv_a_norm.weight",
                     "attention.kv_b.weight", "attention.o.weight"},
                    "multi-head latent attention");
    return std::make_unique<CachedLatentAttention>(config, capacity, device,
                                                   dtype);
  }
  return nullptr;
}

} // namespace forge
