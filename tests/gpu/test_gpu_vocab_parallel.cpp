// The vocabulary-parallel CUDA ops against their CPU references on fresh random data, the
// vocabulary split into T shards and the group's all-reduces done on the host (NOTE
// [Vocabulary-parallel embedding], NOTE [Vocabulary-parallel cross-entropy]):
//  - the shard embedding's lookup exactly and its backward within fp32 rounding, bitwise
//    the same twice, rows of ids held by other shards left as they were;
//  - the cross-entropy phases: each rank's max exactly, its sums within fp32 rounding, and
//    the losses and the ranks' gradients put side by side against the unsharded CPU
//    cross_entropy_forward_backward, with a separate gradient, in place, without, and on
//    logits 2 bytes past a 16-byte boundary. Shards of 8 to 37984 columns: multiples of 8
//    (16-byte accesses) and not (the scalar path), blocks of 32 to 512 threads.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "../cpu/vocab_parallel_testing.h"
#include "gpu_testing.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/vocab_parallel_cross_entropy.h"

namespace forge::gpu_test {
namespace {

using testing::shard_begin;
using testing::shard_size;

// Random ids, the first positions taking the first and last id of every shard.
Tensor ids_in_every_shard(int64_t count, int64_t vocab, int64_t shards, Rng& rng) {
  Tensor ids = random_ids(count, vocab, rng);
  int32_t* p = ids.data<int32_t>();
  for (int64_t r = 0, n = 0; r < shards && n + 1 < count; ++r, n += 2) {
    p[n] = static_cast<int32_t>(shard_begin(vocab, shards, r));
    p[n + 1] = static_cast<int32_t>(shard_begin(vocab, shards, r + 1) - 1);
  }
  return ids;
}

TEST(GpuVocabParallel, EmbeddingShardsMatchCpu) {
  Rng rng(seed_for_current_test());
  struct Case {
    int64_t count, vocab, hidden, shards;
  };
  for (Case c : {Case{1, 5, 8, 2}, Case{77, 13, 64, 4}, Case{2048, 32000, 512, 8}, Case{513, 128256, 64, 8},
                 Case{1037, 9, 4096, 2}}) {
    Tensor table = random_bf16_values({c.vocab, c.hidden}, rng);
    Tensor ids = ids_in_every_shard(c.count, c.vocab, c.shards, rng);
    Tensor idsg = ids.to(Device::CUDA);
    Tensor dout = random_bf16_values({c.count, c.hidden}, rng);
    Tensor doutg = to_gpu(dout, DType::BF16);
    for (int64_t r = 0; r < c.shards; ++r) {
      const int64_t begin = shard_begin(c.vocab, c.shards, r), rows = shard_size(c.vocab, c.shards, r);
      const std::string where = fmt::format("count {} vocab {} hidden {} shard {} of {}", c.count, c.vocab, c.hidden,
                                            r, c.shards);
      Tensor shard = table.narrow(begin, begin + rows).clone();
      Tensor out = Tensor::empty({c.count, c.hidden});
      embedding_shard_forward(out, ids, shard, begin, c.vocab);
      Tensor outg = poisoned_gpu({c.count, c.hidden}, DType::BF16);
      embedding_shard_forward(outg, idsg, to_gpu(shard, DType::BF16), begin, c.vocab);
      EXPECT_EQ(relative_l2(to_cpu_f32(outg), out), 0.0) << where;

      Tensor d0 = random_f32({rows, c.hidden}, rng);
      Tensor dshard = d0.clone();
      embedding_shard_backward(dshard, dout, ids, begin, c.vocab);
      Tensor first = d0.to(Device::CUDA), second = d0.to(Device::CUDA);
      embedding_shard_backward(first, doutg, idsg, begin, c.vocab);
      embedding_shard_backward(second, doutg, idsg, begin, c.vocab);
      Tensor got = to_cpu_f32(first), again = to_cpu_f32(second);
      EXPECT_LT(relative_l2(got, dshard), 1e-6) << where;
      EXPECT_EQ(std::memcmp(got.raw(), again.raw(), got.nbytes()), 0) << "two runs differ: " << where;
      std::vector<bool> hit(static_cast<size_t>(rows), false);
      for (int64_t n = 0; n < c.count; ++n) {
        const int64_t row = ids.data<int32_t>()[n] - begin;
        if (row >= 0 && row < rows) hit[static_cast<size_t>(row)] = true;
      }
      int64_t changed = 0;
      for (int64_t v = 0; v < rows; ++v)
        if (!hit[static_cast<size_t>(v)])
          changed += std::memcmp(got.data<float>() + v * c.hidden, d0.data<float>() + v * c.hidden,
                                 sizeof(float) * c.hidden) != 0;
      EXPECT_EQ(changed, 0) << "rows without a token changed: " << where;
    }
  }
}

// Targets in every shard (its first and last class), the middle row ignored where there
// are more than two.
Tensor shard_edge_targets(int64_t rows, int64_t vocab, int64_t shards, Rng& rng) {
  Tensor targets = ids_in_every_shard(rows, vocab, shards, rng);
  if (rows > 2) targets.data<int32_t>()[rows / 2] = kIgnoreIndex;
  return targets;
}

struct CrossEntropyCase {
  int64_t rows, vocab, shards;
};

// Shards of 8 (one vector, a block of 32 threads), 12 and 250.75 on average (scalar), 4000
// and 16032 (Llama 2 and 3 split 8 ways), 37984 (Qwen 2 split 4 ways), 50304 / 2.
constexpr CrossEntropyCase kCases[] = {{11, 64, 8},    {1, 24, 2},     {33, 1003, 4}, {57, 32000, 8},
                                       {300, 128256, 8}, {7, 151936, 4}, {5, 50304, 2}};

TEST(GpuVocabParallel, CrossEntropyPhasesMatchCpu) {
  Rng rng(seed_for_current_test());
  const float grad_scale = 0.25f;
  for (CrossEntropyCase c : kCases) {
    const std::string where = fmt::format("{} x {} in {} shards", c.rows, c.vocab, c.shards);
    Tensor logits = random_bf16_values({c.rows, c.vocab}, rng, 3.0);
    Tensor targets = shard_edge_targets(c.rows, c.vocab, c.shards, rng);
    Tensor losses = Tensor::empty({c.rows}), dlogits = Tensor::empty({c.rows, c.vocab});
    cross_entropy_forward_backward(losses, dlogits, logits, targets, kIgnoreIndex, grad_scale);
    const Tensor tg = targets.to(Device::CUDA);

    std::vector<Tensor> shard_logits, shard_logits_gpu, row_max, row_max_gpu;
    for (int64_t r = 0; r < c.shards; ++r) {
      shard_logits.push_back(
          testing::shard_columns(logits, shard_begin(c.vocab, c.shards, r), shard_size(c.vocab, c.shards, r)));
      shard_logits_gpu.push_back(to_gpu(shard_logits.back(), DType::BF16));
      row_max.push_back(Tensor::empty({c.rows}));
      vocab_parallel_cross_entropy_max(row_max.back(), shard_logits.back());
      Tensor mg = poisoned_gpu({c.rows}, DType::F32);
      vocab_parallel_cross_entropy_max(mg, shard_logits_gpu.back());
      row_max_gpu.push_back(to_cpu_f32(mg));
      EXPECT_EQ(relative_l2(row_max_gpu.back(), row_max.back()), 0.0) << "max, shard " << r << ": " << where;
    }
    testing::all_reduce_max(row_max);
    testing::all_reduce_max(row_max_gpu);

    std::vector<Tensor> sums, sums_gpu;
    for (int64_t r = 0; r < c.shards; ++r) {
      const int64_t begin = shard_begin(c.vocab, c.shards, r);
      sums.push_back(Tensor::empty({2, c.rows}));
      vocab_parallel_cross_entropy_sums(sums.back(), shard_logits[r], row_max[r], targets, begin, kIgnoreIndex);
      Tensor sg = poisoned_gpu({2, c.rows}, DType::F32);
      vocab_parallel_cross_entropy_sums(sg, shard_logits_gpu[r], row_max_gpu[r].to(Device::CUDA), tg, begin,
                                        kIgnoreIndex);
      sums_gpu.push_back(to_cpu_f32(sg));
      EXPECT_LT(relative_l2(sums_gpu.back(), sums.back()), kF32Tolerance) << "sums, shard " << r << ": " << where;
    }
    testing::all_reduce_sum(sums_gpu);

    Tensor separate = Tensor::empty({c.rows, c.vocab}), in_place = Tensor::empty({c.rows, c.vocab});
    for (int64_t r = 0; r < c.shards; ++r) {
      const int64_t begin = shard_begin(c.vocab, c.shards, r), size = shard_size(c.vocab, c.shards, r);
      const Tensor mg = row_max_gpu[r].to(Device::CUDA), sg = sums_gpu[r].to(Device::CUDA);
      const Tensor& xg = shard_logits_gpu[r];
      Tensor lossg = poisoned_gpu({c.rows}, DType::F32), dg = poisoned_gpu({c.rows, size}, DType::BF16);
      vocab_parallel_cross_entropy_finish(lossg, dg, xg, mg, sg, tg, begin, kIgnoreIndex, grad_scale);
      EXPECT_LT(relative_l2(to_cpu_f32(lossg), losses), kF32Tolerance) << "losses, shard " << r << ": " << where;
      EXPECT_EQ(relative_l2(to_cpu_f32(xg), shard_logits[r]), 0.0) << "the logits are left as they were: " << where;
      testing::put_columns(separate, to_cpu_f32(dg), begin);

      Tensor loss_only = poisoned_gpu({c.rows}, DType::F32);
      vocab_parallel_cross_entropy_finish(loss_only, Tensor(), xg, mg, sg, tg, begin, kIgnoreIndex, grad_scale);
      EXPECT_EQ(relative_l2(to_cpu_f32(loss_only), to_cpu_f32(lossg)), 0.0) << "loss only: " << where;

      // In place, on logits 2 bytes past a 16-byte boundary.
      Tensor storage = poisoned_gpu({c.rows * size + 1}, DType::BF16);
      Tensor shifted = storage.narrow(1, c.rows * size + 1).view({c.rows, size});
      shifted.copy_from(xg);
      Tensor loss_shifted = poisoned_gpu({c.rows}, DType::F32);
      vocab_parallel_cross_entropy_finish(loss_shifted, shifted, shifted, mg, sg, tg, begin, kIgnoreIndex,
                                          grad_scale);
      EXPECT_EQ(relative_l2(to_cpu_f32(loss_shifted), to_cpu_f32(lossg)), 0.0) << "unaligned: " << where;
      testing::put_columns(in_place, to_cpu_f32(shifted), begin);
    }
    EXPECT_LT(relative_l2(separate, dlogits), kBf16Tolerance) << "gradient: " << where;
    EXPECT_LT(relative_l2(in_place, dlogits), kBf16Tolerance) << "gradient in place, unaligned: " << where;
  }
}

}  // namespace
}  // namespace forge::gpu_test
