// cuDNN chunk attention (NOTE [Chunk attention] in ops/attention_chunk.h: a chunk of
// queries against keys and values of their own, the causal diagonal at the bottom right)
// against the CPU reference, forward and backward: context parallelism's chunks at Llama
// shapes (head dim 128, grouped-query attention), the first and last chunk of a sequence,
// odd lengths, sliding windows that reach back across the chunk's start, and the bands of
// ring attention's pairs of chunks under a window (NOTE [Full chunk attention with a sliding
// window]).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "gpu_testing.h"
#include "ops/attention_chunk.h"

namespace forge::gpu_test {
namespace {

struct ChunkCase {
  int64_t batch, queries, position, kv_seq, q_heads, kv_heads, head_dim, window;
  bool full = false;  // not causal: kv lies before the chunk (a band with a window)
};

// lse with rows that see no key (-inf): those must be -inf on both sides, the rest within
// the relative L2 tolerance; the -inf rows count.
double lse_gap(const Tensor& got, const Tensor& want, int64_t& no_key_rows) {
  Tensor g = got.clone(), w = want.clone();
  for (int64_t i = 0; i < w.numel(); ++i) {
    float &a = g.data<float>()[i], &b = w.data<float>()[i];
    if (std::isinf(b) && b < 0) {
      ++no_key_rows;
      if (!(std::isinf(a) && a < 0)) return INFINITY;
      a = b = 0.0f;
    } else if (!std::isfinite(a)) {
      return INFINITY;
    }
  }
  return relative_l2(g, w);
}

// The elements [begin, begin + width) of every `row`-element row of a CPU fp32 tensor.
Tensor columns(const Tensor& t, int64_t row, int64_t begin, int64_t width) {
  Tensor out = Tensor::empty({t.numel() / row, width});
  copy_columns(out, 0, t.view({t.numel() / row, row}), begin, width);
  return out;
}

void expect_chunk_matches_cpu(const ChunkCase& c, Rng& rng) {
  const std::string what = fmt::format("b{} lq{} at {} of {} hq{} hkv{} d{} w{}{}", c.batch, c.queries, c.position,
                                       c.kv_seq, c.q_heads, c.kv_heads, c.head_dim, c.window, c.full ? " full" : "");
  AttentionShape shape{c.q_heads, c.kv_heads, c.window, 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                       c.head_dim};
  shape.causal = !c.full;
  const int64_t heads = c.q_heads + 2 * c.kv_heads, row = heads * c.head_dim, q_width = c.q_heads * c.head_dim;
  Tensor qkv = random_bf16_values({c.batch, c.queries, heads, c.head_dim}, rng);
  Tensor kv = random_bf16_values({c.batch, c.kv_seq, 2 * c.kv_heads, c.head_dim}, rng);
  Tensor out = Tensor::empty({c.batch, c.queries, c.q_heads, c.head_dim});
  Tensor lse = Tensor::empty({c.batch, c.q_heads, c.queries});
  attention_chunk_forward(out, lse, qkv, kv, c.position, shape);

  const Tensor qkvg = to_gpu(qkv, DType::BF16), kvg = to_gpu(kv, DType::BF16);
  Tensor outg = poisoned_gpu(out.shape(), DType::BF16), lseg = poisoned_gpu(lse.shape(), DType::F32);
  attention_chunk_forward(outg, lseg, qkvg, kvg, c.position, shape);
  EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance) << what;
  int64_t no_key_rows = 0;
  EXPECT_LT(lse_gap(to_cpu_f32(lseg), lse, no_key_rows), kF32Tolerance) << what;
  if (no_key_rows > 0)
    std::printf("%s: %lld query rows see no key\n", what.c_str(), static_cast<long long>(no_key_rows));

  Tensor dout = random_bf16_values(out.shape(), rng);
  Tensor dqkv = Tensor::empty(qkv.shape()), dkv = Tensor::empty(kv.shape());
  attention_chunk_backward(dqkv, dkv, dout, qkv, kv, out, lse, c.position, shape);
  // dqkv's key/value heads must come back as they went in; dkv is poisoned, so a position
  // left unwritten (past the chunk's keys, which must be zero) shows.
  const Tensor before = random_bf16_values(qkv.shape(), rng);
  Tensor dqkvg = to_gpu(before, DType::BF16), dkvg = poisoned_gpu(kv.shape(), DType::BF16);
  attention_chunk_backward(dqkvg, dkvg, to_gpu(dout, DType::BF16), qkvg, kvg, outg, lseg, c.position, shape);
  const Tensor got = to_cpu_f32(dqkvg);
  EXPECT_LT(relative_l2(columns(got, row, 0, q_width), columns(dqkv, row, 0, q_width)), 2 * kBf16Tolerance) << what;
  EXPECT_EQ(relative_l2(columns(got, row, q_width, row - q_width), columns(before, row, q_width, row - q_width)), 0.0)
      << what;
  EXPECT_LT(relative_l2(to_cpu_f32(dkvg), dkv), 2 * kBf16Tolerance) << what;
}

// Context parallelism over 4 ranks of a 2048-token sequence at Llama 3 8B's attention
// (chunks of 256; 32 query and 8 key/value heads of 128): rank 0's chunks 0 and 7, rank 2's
// 2 and 5.
TEST(GpuAttentionChunk, LlamaContextParallelChunksMatchCpu) {
  Rng rng(seed_for_current_test());
  for (int64_t chunk : {0, 7, 2, 5}) expect_chunk_matches_cpu({1, 256, chunk * 256, 2048, 32, 8, 128, 0}, rng);
}

// Batches, MHA and GQA at other ratios, odd lengths, a chunk that sees only itself and one
// that sees everything.
TEST(GpuAttentionChunk, OddShapesMatchCpu) {
  Rng rng(seed_for_current_test());
  for (ChunkCase c : {ChunkCase{2, 37, 0, 111, 4, 4, 64, 0}, ChunkCase{2, 37, 74, 111, 4, 4, 64, 0},
                      ChunkCase{3, 64, 64, 256, 8, 2, 128, 0}, ChunkCase{1, 100, 156, 256, 4, 1, 64, 0},
                      ChunkCase{2, 2, 5, 9, 2, 1, 64, 0}})
    expect_chunk_matches_cpu(c, rng);
}

// Sliding windows inside the chunk and reaching back past its first position.
TEST(GpuAttentionChunk, SlidingWindowMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (ChunkCase c : {ChunkCase{2, 128, 256, 512, 8, 2, 128, 16}, ChunkCase{1, 128, 384, 512, 8, 2, 128, 300},
                      ChunkCase{2, 50, 30, 100, 4, 2, 64, 1}})
    expect_chunk_matches_cpu(c, rng);
}

// Ring attention's pairs under a window: chunks of L against key chunks d = mL before them
// (t = W - d): bands (t 72, 1, 8), trimmed bands (t -28: 99 queries see keys [29, 128); t
// -125: 2 queries, the fewest cuDNN takes; t -8 on odd chunks of 37), and a window that
// covers the pair (the full chunk), over batches and GQA; a trimmed band of one query is a
// clear error.
TEST(GpuAttentionChunk, WindowBandMatchesCpu) {
  Rng rng(seed_for_current_test());
  const ChunkCase cases[] = {{2, 128, 128, 128, 8, 2, 128, 200, true}, {1, 128, 256, 128, 8, 2, 128, 257, true},
                             {2, 64, 128, 64, 4, 4, 64, 136, true},    {2, 128, 128, 128, 8, 2, 128, 100, true},
                             {2, 128, 256, 128, 4, 1, 64, 131, true},  {3, 37, 74, 37, 4, 2, 64, 66, true},
                             {2, 64, 64, 64, 4, 2, 64, 500, true}};
  for (const ChunkCase& c : cases)
    expect_chunk_matches_cpu(c, rng);
  AttentionShape shape{2, 1, 130, 0.125f, 64};
  shape.causal = false;  // t = 130 - 256 = -126: one query of 128 sees one key
  Tensor qkv = poisoned_gpu({1, 128, 4, 64}, DType::BF16), kv = poisoned_gpu({1, 128, 2, 64}, DType::BF16);
  Tensor out = poisoned_gpu({1, 128, 2, 64}, DType::BF16), lse = poisoned_gpu({1, 2, 128}, DType::F32);
  EXPECT_THROW(attention_chunk_forward(out, lse, qkv, kv, 256, shape), Error);
}

TEST(GpuAttentionChunk, SingleQueryIsAClearError) {
  Tensor qkv = poisoned_gpu({1, 1, 3, 64}, DType::BF16), kv = poisoned_gpu({1, 4, 2, 64}, DType::BF16);
  Tensor out = poisoned_gpu({1, 1, 1, 64}, DType::BF16), lse = poisoned_gpu({1, 1, 1}, DType::F32);
  EXPECT_THROW(attention_chunk_forward(out, lse, qkv, kv, 2, AttentionShape{1, 1, 0, 0.125f, 64}), Error);
}

}  // namespace
}  // namespace forge::gpu_test
