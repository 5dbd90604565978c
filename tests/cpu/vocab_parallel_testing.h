// Helpers for the vocabulary-parallel op tests, CPU and GPU (NOTE [Vocabulary-parallel
// embedding], NOTE [Vocabulary-parallel cross-entropy]): the vocabulary split into T
// contiguous shards, a shard's columns cut from (and put back into) full [N, V] fp32 host
// tensors, and the group's all-reduces done on the host.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace forge::testing {

// Shard r of T over a vocabulary of `vocab`: [vocab * r / T, vocab * (r + 1) / T).
inline int64_t shard_begin(int64_t vocab, int64_t shards, int64_t r) { return vocab * r / shards; }
inline int64_t shard_size(int64_t vocab, int64_t shards, int64_t r) {
  return shard_begin(vocab, shards, r + 1) - shard_begin(vocab, shards, r);
}

// Columns [begin, begin + size) of an fp32 host tensor [N, V], as a new [N, size] tensor.
inline Tensor shard_columns(const Tensor& full, int64_t begin, int64_t size) {
  const int64_t rows = full.dim(0), vocab = full.dim(1);
  Tensor shard = Tensor::empty({rows, size});
  for (int64_t n = 0; n < rows; ++n)
    std::copy_n(full.data<float>() + n * vocab + begin, size, shard.data<float>() + n * size);
  return shard;
}

// Writes an fp32 host shard [N, size] into columns [begin, begin + size) of full [N, V].
inline void put_columns(const Tensor& full, const Tensor& shard, int64_t begin) {
  const int64_t rows = full.dim(0), vocab = full.dim(1), size = shard.dim(1);
  for (int64_t n = 0; n < rows; ++n)
    std::copy_n(shard.data<float>() + n * size, size, full.data<float>() + n * vocab + begin);
}

// The all-reduces of the group over fp32 host tensors of one shape: every tensor becomes
// the elementwise max (or sum, in fp32 and rank order) of them all.
inline void all_reduce_max(const std::vector<Tensor>& ranks) {
  for (int64_t i = 0; i < ranks[0].numel(); ++i) {
    float m = ranks[0].data<float>()[i];
    for (const Tensor& t : ranks) m = std::max(m, t.data<float>()[i]);
    for (const Tensor& t : ranks) t.data<float>()[i] = m;
  }
}

inline void all_reduce_sum(const std::vector<Tensor>& ranks) {
  for (int64_t i = 0; i < ranks[0].numel(); ++i) {
    float s = 0.0f;
    for (const Tensor& t : ranks) s += t.data<float>()[i];
    for (const Tensor& t : ranks) t.data<float>()[i] = s;
  }
}

}  // namespace forge::testing
