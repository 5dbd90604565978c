// Helpers shared by the tests that train or run a whole model (test_model.cpp,
// test_distributed_fsdp.cpp): a tiny Llama-shaped config and random token ids.
#pragma once

#include <cstdint>

#include "core/rng.h"
#include "core/tensor.h"
#include "model/config.h"

namespace forge::testing {

// Odd sizes (vocabulary 37, hidden 24, FFN 40) so no dimension is a convenient multiple.
inline ModelConfig tiny(bool tied = false, int64_t num_layers = 2) {
  ModelConfig c;
  c.name = "tiny";
  c.vocab_size = 37;
  c.hidden_size = 24;
  c.num_layers = num_layers;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 40;
  c.max_seq_len = 64;
  c.tie_word_embeddings = tied;
  return c;
}

// [b, t] int32 ids below `vocab`, drawn from `seed`.
inline Tensor random_tokens(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  Tensor x = Tensor::empty({b, t}, DType::I32);
  Rng rng(seed);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<int32_t>()[i] = static_cast<int32_t>(rng.below(vocab));
  return x;
}

}  // namespace forge::testing
