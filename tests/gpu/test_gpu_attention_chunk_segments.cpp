// cuDNN chunk attention with packed examples (NOTE [Chunk attention with packed examples] in
// ops/attention_chunk.h: per example the chunk meets, its query rows in the chunk against its
// keys from its first position to the chunk's end, ragged on both sides, the causal diagonal
// at the bottom right) against the CPU reference, forward and backward, on fresh random
// data: random example lengths (some longer than the chunk, some of one token, padding runs),
// the first, a middle and the last chunk of a sequence, context parallelism's chunks at
// Llama shapes, and sliding windows; and ring attention's chunk pairs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "gpu_testing.h"
#include "ops/attention_chunk.h"

namespace forge::gpu_test {
namespace {

struct SegmentChunkCase {
  int64_t batch, queries, position, kv_seq, q_heads, kv_heads, head_dim, window;
  int64_t max_length;  // examples of 1 to max_length tokens
};

// Rows cut into examples of random lengths (1 to max_length tokens), the last run of each
// row marked as padding (-1) as the loader does.
Tensor random_segments(int64_t batch, int64_t seq, int64_t max_length, Rng& rng) {
  Tensor ids = Tensor::empty({batch, seq}, DType::I32);
  for (int64_t b = 0; b < batch; ++b) {
    int32_t id = 0;
    int64_t left = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_length)));
    for (int64_t t = 0; t < seq; ++t) {
      if (left-- == 0) {
        ++id;
        left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_length)));
      }
      ids.data<int32_t>()[b * seq + t] = id;
    }
    for (int64_t t = seq - 1; t > 0 && ids.data<int32_t>()[b * seq + t] == id && id > 0; --t)
      ids.data<int32_t>()[b * seq + t] = -1;
  }
  return ids;
}

// The GPU keeps ragged statistics token-major, [B * Lq, Hq]; the CPU [B, Hq, Lq].
Tensor token_major(const Tensor& lse) {
  const int64_t b = lse.dim(0), h = lse.dim(1), t = lse.dim(2);
  Tensor out = Tensor::empty({b, h, t});
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < h; ++j)
      for (int64_t k = 0; k < t; ++k)
        out.data<float>()[(i * t + k) * h + j] = lse.data<float>()[(i * h + j) * t + k];
  return out;
}

// The elements [begin, begin + width) of every `row`-element row of a CPU fp32 tensor.
Tensor columns(const Tensor& t, int64_t row, int64_t begin, int64_t width) {
  Tensor out = Tensor::empty({t.numel() / row, width});
  copy_columns(out, 0, t.view({t.numel() / row, row}), begin, width);
  return out;
}

void expect_chunk_matches_cpu(const SegmentChunkCase& c, const Tensor& ids, Rng& rng) {
  const std::string what = fmt::format("b{} lq{} at {} of {} hq{} hkv{} d{} w{} examples up to {}", c.batch,
                                       c.queries, c.position, c.kv_seq, c.q_heads, c.kv_heads, c.head_dim, c.window,
                                       c.max_length);
  const AttentionShape shape{c.q_heads, c.kv_heads, c.window, 1.0f / std::sqrt(static_cast<float>(c.head_dim)),
                             c.head_dim};
  const AttentionChunkSegments cpu_segments =
      attention_chunk_segments(ids, c.position, c.queries, shape, Device::CPU);
  const AttentionChunkSegments gpu_segments =
      attention_chunk_segments(ids, c.position, c.queries, shape, Device::CUDA);
  const int64_t heads = c.q_heads + 2 * c.kv_heads, row = heads * c.head_dim, q_width = c.q_heads * c.head_dim;
  Tensor qkv = random_bf16_values({c.batch, c.queries, heads, c.head_dim}, rng);
  Tensor kv = random_bf16_values({c.batch, c.kv_seq, 2 * c.kv_heads, c.head_dim}, rng);
  Tensor out = Tensor::empty({c.batch, c.queries, c.q_heads, c.head_dim});
  Tensor lse = Tensor::empty({c.batch, c.q_heads, c.queries});
  attention_chunk_forward(out, lse, qkv, kv, c.position, shape, &cpu_segments);

  const Tensor qkvg = to_gpu(qkv, DType::BF16), kvg = to_gpu(kv, DType::BF16);
  Tensor outg = poisoned_gpu(out.shape(), DType::BF16), lseg = poisoned_gpu(lse.shape(), DType::F32);
  attention_chunk_forward(outg, lseg, qkvg, kvg, c.position, shape, &gpu_segments);
  EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance) << what;
  EXPECT_LT(relative_l2(to_cpu_f32(lseg), token_major(lse)), kF32Tolerance) << what;

  Tensor dout = random_bf16_values(out.shape(), rng);
  Tensor dqkv = Tensor::empty(qkv.shape()), dkv = Tensor::empty(kv.shape());
  attention_chunk_backward(dqkv, dkv, dout, qkv, kv, out, lse, c.position, shape, &cpu_segments);
  // dqkv's key/value heads must come back as they went in; dkv is poisoned, so a position
  // left unwritten (of no example of the chunk, or past its end: zero) shows.
  const Tensor before = random_bf16_values(qkv.shape(), rng);
  Tensor dqkvg = to_gpu(before, DType::BF16), dkvg = poisoned_gpu(kv.shape(), DType::BF16);
  attention_chunk_backward(dqkvg, dkvg, to_gpu(dout, DType::BF16), qkvg, kvg, outg, lseg, c.position, shape,
                           &gpu_segments);
  const Tensor got = to_cpu_f32(dqkvg);
  EXPECT_LT(relative_l2(columns(got, row, 0, q_width), columns(dqkv, row, 0, q_width)), 2 * kBf16Tolerance) << what;
  EXPECT_EQ(relative_l2(columns(got, row, q_width, row - q_width), columns(before, row, q_width, row - q_width)), 0.0)
      << what;
  EXPECT_LT(relative_l2(to_cpu_f32(dkvg), dkv), 2 * kBf16Tolerance) << what;
}

void expect_chunks_match_cpu(const SegmentChunkCase& c, Rng& rng) {
  const Tensor ids = random_segments(c.batch, c.kv_seq, c.max_length, rng);
  expect_chunk_matches_cpu(c, ids, rng);
}

// Context parallelism over 4 ranks of 2048-token rows at Llama 3 8B's attention (chunks of
// 256; 32 query and 8 key/value heads of 128), examples up to 700 tokens (several chunks) and
// up to 100 (several per chunk): rank 0's chunks 0 and 7, rank 2's 2 and 5.
TEST(GpuAttentionChunkSegments, LlamaContextParallelChunksMatchCpu) {
  Rng rng(seed_for_current_test());
  for (int64_t max_length : {700, 100}) {
    const Tensor ids = random_segments(1, 2048, max_length, rng);
    for (int64_t chunk : {0, 7, 2, 5})
      expect_chunk_matches_cpu({1, 256, chunk * 256, 2048, 32, 8, 128, 0, max_length}, ids, rng);
  }
}

// Batches, MHA and GQA, odd lengths, one-token examples, an example that covers the chunk.
TEST(GpuAttentionChunkSegments, OddLayoutsMatchCpu) {
  Rng rng(seed_for_current_test());
  for (SegmentChunkCase c :
       {SegmentChunkCase{2, 37, 0, 111, 4, 4, 64, 0, 20}, SegmentChunkCase{2, 37, 74, 111, 4, 4, 64, 0, 20},
        SegmentChunkCase{3, 64, 64, 256, 8, 2, 128, 0, 200}, SegmentChunkCase{1, 100, 156, 256, 4, 1, 64, 0, 3},
        SegmentChunkCase{2, 2, 5, 9, 2, 1, 64, 0, 4}, SegmentChunkCase{2, 64, 128, 256, 4, 2, 64, 0, 256}})
    expect_chunks_match_cpu(c, rng);
}

// Sliding windows inside examples and reaching back past the chunk's first position.
TEST(GpuAttentionChunkSegments, SlidingWindowMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (SegmentChunkCase c : {SegmentChunkCase{2, 128, 256, 512, 8, 2, 128, 16, 100},
                             SegmentChunkCase{1, 128, 384, 512, 8, 2, 128, 300, 400},
                             SegmentChunkCase{2, 50, 30, 100, 4, 2, 64, 1, 30}})
    expect_chunks_match_cpu(c, rng);
}

// Ring attention's pairs (NOTE [Ring attention with packed examples] in
// model/context_parallel_ring.h): every (query chunk, key chunk) pair of rows cut into chunks
// of `chunk`, the chunk's own keys (causal per example) and each past chunk (NOTE [Full chunk
// attention with packed examples]: cuDNN's ragged form with the padding mask only); against the
// CPU, forward and backward. The queries that see none of the pair's keys must come back with
// out 0 and lse -inf although the tensors were poisoned, and dq 0; pairs no query sees (the
// ring skips them) are counted, not run.
void expect_ring_pairs_match_cpu(int64_t batch, int64_t seq, int64_t chunk, int64_t q_heads, int64_t kv_heads,
                                 int64_t head_dim, int64_t max_length, Rng& rng) {
  const AttentionShape shape{q_heads, kv_heads, 0, 1.0f / std::sqrt(static_cast<float>(head_dim)), head_dim};
  const Tensor ids = random_segments(batch, seq, max_length, rng);
  const int64_t heads = q_heads + 2 * kv_heads, row = heads * head_dim, q_width = q_heads * head_dim;
  int64_t computed = 0, unseen = 0;
  for (int64_t a = 0; a < seq / chunk; ++a)
    for (int64_t k = 0; k <= a; ++k) {
      const std::string what = fmt::format("b{} chunks of {} of {}: queries {} keys {}, examples up to {}", batch,
                                           chunk, seq, a, k, max_length);
      const AttentionChunkSegments cpu_segments =
          attention_chunk_pair_segments(ids, a * chunk, k * chunk, chunk, shape, Device::CPU);
      if (cpu_segments.num_examples == 0) {
        ++unseen;
        continue;
      }
      ++computed;
      const AttentionChunkSegments gpu_segments =
          attention_chunk_pair_segments(ids, a * chunk, k * chunk, chunk, shape, Device::CUDA);
      AttentionShape pair = shape;
      pair.causal = a == k;
      Tensor qkv = random_bf16_values({batch, chunk, heads, head_dim}, rng);
      Tensor kv = random_bf16_values({batch, chunk, 2 * kv_heads, head_dim}, rng);
      Tensor out = Tensor::empty({batch, chunk, q_heads, head_dim}), lse = Tensor::empty({batch, q_heads, chunk});
      attention_chunk_forward(out, lse, qkv, kv, 0, pair, &cpu_segments);
      const Tensor qkvg = to_gpu(qkv, DType::BF16), kvg = to_gpu(kv, DType::BF16);
      Tensor outg = poisoned_gpu(out.shape(), DType::BF16), lseg = poisoned_gpu(lse.shape(), DType::F32);
      attention_chunk_forward(outg, lseg, qkvg, kvg, 0, pair, &gpu_segments);
      EXPECT_LT(relative_l2(to_cpu_f32(outg), out), kBf16Tolerance) << what;
      const Tensor want_lse = token_major(lse), got_lse = to_cpu_f32(lseg);
      double gap = 0, scale = 0;
      for (int64_t n = 0; n < want_lse.numel(); ++n) {
        const float want = want_lse.data<float>()[n], got = got_lse.data<float>()[n];
        if (want == -INFINITY) {
          ASSERT_EQ(got, -INFINITY) << what << ": a query that sees no key, lse element " << n;
          continue;
        }
        gap += (double(got) - want) * (double(got) - want);
        scale += double(want) * want;
      }
      EXPECT_LT(std::sqrt(gap / std::max(scale, 1e-30)), kF32Tolerance) << what;

      Tensor dout = random_bf16_values(out.shape(), rng);
      Tensor dqkv = Tensor::empty(qkv.shape()), dkv = Tensor::empty(kv.shape());
      attention_chunk_backward(dqkv, dkv, dout, qkv, kv, out, lse, 0, pair, &cpu_segments);
      const Tensor before = random_bf16_values(qkv.shape(), rng);
      Tensor dqkvg = to_gpu(before, DType::BF16), dkvg = poisoned_gpu(kv.shape(), DType::BF16);
      attention_chunk_backward(dqkvg, dkvg, to_gpu(dout, DType::BF16), qkvg, kvg, outg, lseg, 0, pair, &gpu_segments);
      const Tensor got = to_cpu_f32(dqkvg);
      EXPECT_LT(relative_l2(columns(got, row, 0, q_width), columns(dqkv, row, 0, q_width)), 2 * kBf16Tolerance)
          << what;
      EXPECT_EQ(relative_l2(columns(got, row, q_width, row - q_width), columns(before, row, q_width, row - q_width)),
                0.0)
          << what;
      EXPECT_LT(relative_l2(to_cpu_f32(dkvg), dkv), 2 * kBf16Tolerance) << what;
    }
  std::printf("chunks of %lld, examples up to %lld: %lld pairs computed, %lld that no query sees\n",
              static_cast<long long>(chunk), static_cast<long long>(max_length), static_cast<long long>(computed),
              static_cast<long long>(unseen));
  EXPECT_GT(computed, seq / chunk) << "some past pairs are seen";
}

// Llama 3 8B's attention over 2048-token rows in chunks of 256 (4 ranks), examples up to 700
// and up to 100 tokens; odd shapes: chunks of 37, MHA and GQA, one-token examples.
TEST(GpuAttentionChunkSegments, RingPairsMatchCpu) {
  Rng rng(seed_for_current_test());
  for (int64_t max_length : {700, 100}) expect_ring_pairs_match_cpu(1, 2048, 256, 32, 8, 128, max_length, rng);
  expect_ring_pairs_match_cpu(2, 222, 37, 4, 4, 64, 20, rng);
  expect_ring_pairs_match_cpu(2, 256, 64, 8, 2, 128, 3, rng);
}

}  // namespace
}  // namespace forge::gpu_test
