#include "model/context_parallel_ring.h"

#include "core/error.h"
#include "ops/attention_merge.h"
#include "ops/elementwise.h"

namespace forge {
namespace {

// The pair's attention (NOTE [Ring attention with a sliding window]): the causal chunk
// attention at position 0 for the diagonal, the full chunk attention otherwise, with the
// window only for a band.
AttentionShape pair_shape(const AttentionShape& shape, RingChunkPair pair) {
  AttentionShape s = shape;
  s.causal = pair == RingChunkPair::Diagonal;
  if (pair == RingChunkPair::Full) s.sliding_window = 0;
  return s;
}

// The pair's position argument: a band's distance from its key chunk to its query chunk.
int64_t pair_position(RingChunkPair pair, int64_t query_chunk, int64_t key_chunk, int64_t chunk) {
  return pair == RingChunkPair::Band || pair == RingChunkPair::TrimmedBand ? (query_chunk - key_chunk) * chunk : 0;
}

}  // namespace

RingChunkPair ring_chunk_pair(int64_t query_chunk, int64_t key_chunk, int64_t chunk, int64_t window) {
  if (key_chunk > query_chunk) return RingChunkPair::Skipped;
  if (key_chunk == query_chunk) return RingChunkPair::Diagonal;
  if (window <= 0) return RingChunkPair::Full;
  const int64_t t = window - (query_chunk - key_chunk) * chunk;
  if (t >= chunk) return RingChunkPair::Full;
  if (t <= 1 - chunk) return RingChunkPair::Skipped;
  return t >= 1 ? RingChunkPair::Band : RingChunkPair::TrimmedBand;
}

void ContextParallelRing::lay_out(ArenaLayout& layout, const StepShape& shape, int64_t q_heads, int64_t kv_heads,
                                  int64_t head_dim) {
  batch_ = shape.micro_batch;
  chunk_ = shape.local_seq_len();
  q_heads_ = q_heads;
  const Shape block{2 * batch_, chunk_, 2 * kv_heads, head_dim};
  for (int i = 0; i < 2; ++i) {
    kv_[i] = layout.take(block, shape.dtype);
    dkv_[i] = layout.take(block, DType::F32);
  }
  step_grad_ = layout.take(block, DType::F32);
  accumulator_ = layout.take({2 * batch_, chunk_, q_heads + 2 * kv_heads, head_dim}, DType::F32);
  part_out_ = layout.take({batch_, chunk_, q_heads, head_dim}, shape.dtype);
  part_lse_ = layout.take({batch_, q_heads, chunk_}, DType::F32);
  part_dqkv_ = layout.take({batch_, chunk_, q_heads + 2 * kv_heads, head_dim}, shape.dtype);
  part_dkv_ = layout.take({batch_, chunk_, 2 * kv_heads, head_dim}, shape.dtype);
}

void ContextParallelRing::set_layout(const ContextParallel& cp, const Tensor* segment_ids,
                                     const AttentionShape& attention, Device device) {
  packed_ = segment_ids != nullptr;
  pair_segments_.clear();
  if (!packed_) return;
  FORGE_CHECK(attention.sliding_window == 0,
              "ring attention (parallelism.context_parallel_rotate_method p2p) with packed examples (data.source sft "
              "or govreport_npy) takes no sliding window (model.sliding_window {}; NOTE [Ring attention with packed "
              "examples]): use parallelism.context_parallel_rotate_method allgather",
              attention.sliding_window);
  const int c = cp.size(), r = cp.rank();
  pair_segments_.resize(static_cast<size_t>(4 * c));
  for (int half = 0; half < 2; ++half)
    for (int owner = 0; owner < c; ++owner)
      for (int key_half = 0; key_half < 2; ++key_half) {
        const int64_t q = context_parallel_chunk(r, c, half), k = context_parallel_chunk(owner, c, key_half);
        if (ring_chunk_pair(q, k) == RingChunkPair::Skipped) continue;
        pair_segments_[pair_index(half, owner, key_half, c)] =
            device == Device::CPU
                ? attention_chunk_pair_segments(*segment_ids, q * chunk_, k * chunk_, chunk_, attention, device)
                : attention_chunk_pair_ragged_on_host(*segment_ids, q * chunk_, k * chunk_, chunk_, attention);
      }
  // On CUDA, every pair's lengths and offsets in one buffer, one copy (the pairs never
  // computed hold empty arrays).
  if (device != Device::CPU) segment_buffer_ = upload_chunk_segments(pair_segments_, device);
}

RingChunkPair ContextParallelRing::pair_of(int half, int owner, int key_half, int ranks, int rank, int64_t window,
                                           const AttentionChunkSegments** segments) const {
  const int64_t q = context_parallel_chunk(rank, ranks, half), k = context_parallel_chunk(owner, ranks, key_half);
  const RingChunkPair pair = ring_chunk_pair(q, k, chunk_, window);
  *segments = nullptr;
  if (!packed_ || pair == RingChunkPair::Skipped) return pair;
  *segments = &pair_segments_[pair_index(half, owner, key_half, ranks)];
  return (*segments)->num_examples == 0 ? RingChunkPair::Skipped : pair;
}

void ContextParallelRing::take_own_block(const Tensor& qkv) {
  const int64_t rows = 2 * batch_ * chunk_, width = qkv.dim(2) * qkv.dim(3);
  const int64_t kv_width = kv_[0].dim(2) * kv_[0].dim(3);
  copy_columns(kv_[0].view({rows, kv_width}), 0, qkv.view({rows, width}), width - kv_width, kv_width);
}

void ContextParallelRing::forward(ContextParallel& cp, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                  const AttentionShape& shape) {
  const int c = cp.size(), r = cp.rank();
  const Tensor running = accumulator_.view({static_cast<int64_t>(accumulator_.numel())})
                             .narrow(0, out.numel())
                             .view({2 * batch_, chunk_, q_heads_, out.dim(3)});
  take_own_block(qkv);
  bool started[2] = {false, false};
  for (int step = 0; step < c; ++step) {
    const Tensor& held = kv_[step % 2];
    const int owner = (r - step + c) % c;  // whose block is held
    if (step + 1 < c) cp.rotate_start({kv_[(step + 1) % 2]}, {held});  // the next block, during this one
    for (int half = 0; half < 2; ++half)
      for (int key_half = 0; key_half < 2; ++key_half) {
        const int64_t q = context_parallel_chunk(r, c, half), k = context_parallel_chunk(owner, c, key_half);
        const AttentionChunkSegments* segments = nullptr;
        const RingChunkPair pair = pair_of(half, owner, key_half, c, r, shape.sliding_window, &segments);
        if (pair == RingChunkPair::Skipped) continue;
        attention_chunk_forward(part_out_, part_lse_, half_of(qkv, half), half_of(held, key_half),
                                pair_position(pair, q, k, chunk_), pair_shape(shape, pair), segments);
        if (started[half]) {
          attention_merge(half_of(running, half), half_of(lse, half), part_out_, part_lse_,
                          token_major_lse(segments));
        } else {
          cast(half_of(running, half), part_out_);
          cast(half_of(lse, half), part_lse_);
          started[half] = true;
        }
      }
    if (step + 1 < c) cp.rotate_wait();
  }
  cast(out, running);
}

void ContextParallelRing::backward(ContextParallel& cp, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv,
                                   const Tensor& out, const Tensor& lse, const AttentionShape& shape) {
  const int c = cp.size(), r = cp.rank();
  const Tensor dq = accumulator_.view(qkv.shape());
  take_own_block(qkv);
  dq.fill_zero();
  part_dqkv_.fill_zero();  // the chunk backward writes only its query heads
  for (int step = 0; step < c; ++step) {
    const Tensor &held = kv_[step % 2], &held_grad = dkv_[step % 2];
    const int owner = (r - step + c) % c;
    if (step + 1 < c) cp.rotate_start({kv_[(step + 1) % 2]}, {held});
    step_grad_.fill_zero();
    for (int half = 0; half < 2; ++half)
      for (int key_half = 0; key_half < 2; ++key_half) {
        const int64_t q = context_parallel_chunk(r, c, half), k = context_parallel_chunk(owner, c, key_half);
        const AttentionChunkSegments* segments = nullptr;
        const RingChunkPair pair = pair_of(half, owner, key_half, c, r, shape.sliding_window, &segments);
        if (pair == RingChunkPair::Skipped) continue;
        attention_chunk_backward(part_dqkv_, part_dkv_, half_of(dout, half), half_of(qkv, half),
                                 half_of(held, key_half), half_of(out, half), half_of(lse, half),
                                 pair_position(pair, q, k, chunk_), pair_shape(shape, pair), segments);
        accumulate(half_of(dq, half), part_dqkv_);
        accumulate(half_of(step_grad_, key_half), part_dkv_);
      }
    // The next block, and the held block's gradient from the ranks that held it before.
    cp.rotate_wait();
    if (step == 0)
      cast(held_grad, step_grad_);
    else
      accumulate(held_grad, step_grad_);
    // On to the next rank during the next step; after the last, to the block's owner.
    cp.rotate_start({dkv_[(step + 1) % 2]}, {held_grad});
  }
  cp.rotate_wait();  // the rank's own block's gradient, summed over every rank's queries
  // dq into the query heads (the key/value heads of dq are zero), then the rank's own keys'
  // and values' gradient, rounded through the free block buffer, into the key/value heads.
  cast(dqkv, dq);
  const int own = c % 2;
  cast(kv_[own], dkv_[own]);
  const int64_t rows = 2 * batch_ * chunk_, width = dqkv.dim(2) * dqkv.dim(3);
  const int64_t kv_width = kv_[0].dim(2) * kv_[0].dim(3);
  copy_columns(dqkv.view({rows, width}), width - kv_width, kv_[own].view({rows, kv_width}), 0, kv_width);
}

}  // namespace forge
