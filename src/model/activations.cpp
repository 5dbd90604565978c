#include "model/activations.h"

#include <algorithm>

#include "core/error.h"

namespace forge {
namespace {

constexpr int64_t kArenaAlignment = 256;

// NOTE [Chunked output head] in transformer.cpp.
constexpr int64_t kHeadChunkBytes = int64_t{2} << 30;
constexpr int64_t kMinHeadChunkRows = 256;

}  // namespace

ActivationCheckpoint activation_checkpoint_from_name(const std::string& name) {
  if (name == "none") return ActivationCheckpoint::None;
  if (name == "selective") return ActivationCheckpoint::Selective;
  if (name == "full") return ActivationCheckpoint::Full;
  FORGE_FAIL("activation_checkpoint.mode must be none, selective or full, got '{}'", name);
}

std::string_view activation_checkpoint_name(ActivationCheckpoint mode) {
  switch (mode) {
    case ActivationCheckpoint::None: return "none";
    case ActivationCheckpoint::Selective: return "selective";
    case ActivationCheckpoint::Full: return "full";
  }
  return "?";
}

Tensor ArenaLayout::take(Shape shape, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t bytes = n * static_cast<int64_t>(dtype_size(dtype));
  const int64_t at = offset_;
  offset_ += (bytes + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
  if (!base_) return Tensor();
  return Tensor::wrap(base_ + at, std::move(shape), dtype, device_);
}

int64_t head_chunk_rows(int64_t tokens, int64_t vocab, DType dtype) {
  int64_t rows = kMinHeadChunkRows;
  while (rows * 2 * vocab * static_cast<int64_t>(dtype_size(dtype)) <= kHeadChunkBytes) rows *= 2;
  return std::min(tokens, rows);
}

void lay_out_activations(ActivationBuffers& b, const ModelConfig& config, int64_t micro_batch, int64_t seq_len,
                         DType dtype, ActivationCheckpoint mode, ArenaLayout& layout) {
  const int64_t n = micro_batch * seq_len, h = config.hidden_size, f = config.ffn_hidden_size;
  const int64_t d = config.resolved_head_dim(), hq = config.num_heads, hkv = config.num_kv_heads;
  auto act = [&](Shape shape) { return layout.take(std::move(shape), dtype); };
  auto stat = [&](Shape shape) { return layout.take(std::move(shape), DType::F32); };
  auto lay_out_layer = [&](LayerActivations& a, bool keep_all, bool keep_costly) {
    if (keep_costly) {
      a.rstd_attn = stat({n});
      a.qkv = act({micro_batch, seq_len, hq + 2 * hkv, d});
      a.attn_out = act({micro_batch, seq_len, hq, d});
      a.lse = stat({micro_batch, hq, seq_len});
      a.mid = act({n, h});
      a.rstd_mlp = stat({n});
      a.gate_up = act({n, 2 * f});
    }
    if (keep_all) {
      a.normed_attn = act({n, h});
      a.normed_mlp = act({n, h});
      a.swiglu_out = act({n, f});
    }
  };

  // What every layer keeps, then (checkpointing) one shared set of what the layers
  // recompute, whose tensors every layer's entry points to.
  b.layers.assign(config.num_layers, LayerActivations{});
  for (LayerActivations& a : b.layers) {
    a.input = act({n, h});
    lay_out_layer(a, mode == ActivationCheckpoint::None, mode != ActivationCheckpoint::Full);
  }
  if (mode != ActivationCheckpoint::None) {
    LayerActivations shared;
    lay_out_layer(shared, /*keep_all=*/true, /*keep_costly=*/mode == ActivationCheckpoint::Full);
    for (LayerActivations& a : b.layers) {
      a.normed_attn = shared.normed_attn;
      a.normed_mlp = shared.normed_mlp;
      a.swiglu_out = shared.swiglu_out;
      if (mode == ActivationCheckpoint::Full) {
        a.rstd_attn = shared.rstd_attn;
        a.qkv = shared.qkv;
        a.attn_out = shared.attn_out;
        a.lse = shared.lse;
        a.mid = shared.mid;
        a.rstd_mlp = shared.rstd_mlp;
        a.gate_up = shared.gate_up;
      }
    }
  }
  b.final_input = act({n, h});
  b.final_rstd = stat({n});
  b.final_normed = act({n, h});
  b.logits_chunk = act({head_chunk_rows(n, config.vocab_size, dtype), config.vocab_size});
  b.losses = stat({n});

  b.d_residual = act({n, h});
  b.d_normed = act({n, h});
  b.d_attn_out = act({n, hq * d});
  b.d_qkv = act({micro_batch, seq_len, hq + 2 * hkv, d});
  b.d_swiglu = act({n, f});
  b.d_gate_up = act({n, 2 * f});
}

int64_t activation_bytes(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, DType dtype,
                         ActivationCheckpoint mode) {
  ActivationBuffers buffers;
  ArenaLayout counting(nullptr, Device::CPU);
  lay_out_activations(buffers, config, micro_batch, seq_len, dtype, mode, counting);
  return counting.bytes();
}

}  // namespace forge
