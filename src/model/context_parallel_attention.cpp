#include "model/context_parallel_attention.h"

#include "core/error.h"
#include "ops/attention_chunk.h"
#include "ops/elementwise.h"

namespace forge {

void ContextParallelAttention::lay_out(ArenaLayout& layout, const StepShape& shape, int64_t q_heads,
                                       int64_t kv_heads, int64_t head_dim, ContextParallelRotate method) {
  const int64_t c = shape.context_parallel;
  batch_ = shape.micro_batch;
  chunk_ = shape.local_seq_len();
  ring_ = method == ContextParallelRotate::Ring;
  if (ring_) {
    ring_attention_.lay_out(layout, shape, q_heads, kv_heads, head_dim);
    return;
  }
  local_kv_ = layout.take({2 * batch_, chunk_, 2 * kv_heads, head_dim}, shape.dtype);
  ranks_kv_ = layout.take({c, 2 * batch_, chunk_, 2 * kv_heads, head_dim}, shape.dtype);
  kv_ = layout.take({batch_, shape.seq_len, 2 * kv_heads, head_dim}, shape.dtype);
  dkv_ = layout.take({batch_, shape.seq_len, 2 * kv_heads, head_dim}, shape.dtype);
  gathered_layer_ = -1;
}

void ContextParallelAttention::prepare(const ContextParallel& cp, const StepShape& shape, Device device) {
  const int64_t b = shape.micro_batch, l = shape.local_seq_len();
  Tensor host = Tensor::empty({2 * b, l}, DType::I32);
  for (int half = 0; half < 2; ++half) {
    const int64_t first = context_parallel_chunk(cp.rank(), cp.size(), half) * l;
    for (int64_t row = half * b; row < (half + 1) * b; ++row)
      for (int64_t i = 0; i < l; ++i) host.data<int32_t>()[row * l + i] = static_cast<int32_t>(first + i);
  }
  positions_ = host.to(device);
  device_ = device;
}

void ContextParallelAttention::set_layout(const ContextParallel& cp, const SequenceLayout* layout,
                                          const AttentionShape& attention) {
  packed_ = layout != nullptr;
  if (ring_) ring_attention_.set_layout(cp, packed_ ? &layout->segments : nullptr, attention, device_);
  if (!packed_) return;
  // NOTE [Packed examples]: the positions restart with each example; per token, so the rank
  // takes its chunks of them as of the tokens.
  Tensor host = Tensor::empty({2 * batch_, chunk_}, DType::I32);
  take_chunks(host, layout->positions, cp.rank(), cp.size());
  packed_positions_ = host.to(device_);
  if (ring_) return;  // the ring's pairs have segments of their own
  for (int half = 0; half < 2; ++half)
    chunk_segments_[half] = attention_chunk_segments(
        layout->segments, context_parallel_chunk(cp.rank(), cp.size(), half) * chunk_, chunk_, attention, device_);
}

void ContextParallelAttention::gather_keys(ContextParallel& cp, int layer, const Tensor& qkv) {
  if (layer == gathered_layer_) return;
  const int64_t width = qkv.dim(2) * qkv.dim(3), kv_width = local_kv_.dim(2) * local_kv_.dim(3);
  copy_columns(local_kv_.view({2 * batch_ * chunk_, kv_width}), 0, qkv.view({2 * batch_ * chunk_, width}),
               width - kv_width, kv_width);
  cp.gather(ranks_kv_, local_kv_);
  for (int q = 0; q < cp.size(); ++q)
    put_chunks(kv_, ranks_kv_.narrow(q, q + 1).view(local_kv_.shape()), q, cp.size());
  gathered_layer_ = layer;
}

void ContextParallelAttention::forward(ContextParallel& cp, int layer, const Tensor& out, const Tensor& lse,
                                       const Tensor& qkv, const AttentionShape& shape) {
  if (ring_) {
    ring_attention_.forward(cp, out, lse, qkv, shape);
    return;
  }
  gathered_layer_ = -1;  // a new forward of the block: its keys and values are new
  gather_keys(cp, layer, qkv);
  for (int half = 0; half < 2; ++half) {
    const int64_t begin = half * batch_, end = begin + batch_;
    attention_chunk_forward(out.narrow(begin, end), lse.narrow(begin, end), qkv.narrow(begin, end), kv_,
                            context_parallel_chunk(cp.rank(), cp.size(), half) * chunk_, shape,
                            packed_ ? &chunk_segments_[half] : nullptr);
  }
}

void ContextParallelAttention::backward(ContextParallel& cp, int layer, const Tensor& dqkv, const Tensor& dout,
                                        const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                        const AttentionShape& shape) {
  if (ring_) {
    ring_attention_.backward(cp, dqkv, dout, qkv, out, lse, shape);
    return;
  }
  gather_keys(cp, layer, qkv);
  // Each chunk's dq, and its dk/dv at every position: the first chunk's into the
  // rank-order buffer (free once kv_ is in sequence order), summed into the second's.
  const Tensor first_dkv = ranks_kv_.view(dkv_.shape());
  for (int half = 0; half < 2; ++half) {
    const int64_t begin = half * batch_, end = begin + batch_;
    attention_chunk_backward(dqkv.narrow(begin, end), half == 0 ? first_dkv : dkv_, dout.narrow(begin, end),
                             qkv.narrow(begin, end), kv_, out.narrow(begin, end), lse.narrow(begin, end),
                             context_parallel_chunk(cp.rank(), cp.size(), half) * chunk_, shape,
                             packed_ ? &chunk_segments_[half] : nullptr);
  }
  accumulate(dkv_, first_dkv);
  // Every position's gradient to the rank that holds it, summed over the group's ranks.
  for (int q = 0; q < cp.size(); ++q)
    take_chunks(ranks_kv_.narrow(q, q + 1).view(local_kv_.shape()), dkv_, q, cp.size());
  cp.reduce_scatter(local_kv_, ranks_kv_);
  const int64_t width = dqkv.dim(2) * dqkv.dim(3), kv_width = local_kv_.dim(2) * local_kv_.dim(3);
  copy_columns(dqkv.view({2 * batch_ * chunk_, width}), width - kv_width,
               local_kv_.view({2 * batch_ * chunk_, kv_width}), 0, kv_width);
}

}  // namespace forge
