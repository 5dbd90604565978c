// Helpers shared by the tests that train or run a whole model (test_model.cpp,
// test_distributed_fsdp.cpp, the LoRA tests): a tiny Llama-shaped config, random token
// ids, LoRA adapters with a nonzero B.
#pragma once

#include <cstdint>

#include "core/rng.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/lora.h"

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

// Llama 3.1 8B's shape (configs/models/llama3.1-8b.yaml), for size and memory arithmetic.
inline ModelConfig llama31_8b() {
  ModelConfig c;
  c.name = "llama3.1-8b";
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.ffn_hidden_size = 14336;
  c.rope_theta = 500000;
  c.max_seq_len = 131072;
  return c;
}

// [b, t] int32 ids below `vocab`, drawn from `seed`.
inline Tensor random_tokens(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  Tensor x = Tensor::empty({b, t}, DType::I32);
  Rng rng(seed);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<int32_t>()[i] = static_cast<int32_t>(rng.below(vocab));
  return x;
}

// Sets every B of `adapters` to small nonzero values (PEFT starts it at zero), so A has
// gradients too.
inline void set_nonzero_lora_b(LoraAdapters& adapters) {
  for (size_t k = 0; k < adapters.targets().size(); ++k)
    for (size_t p = 0; p < adapters.targets()[k].parts.size(); ++p) {
      Tensor b = adapters.part_matrix(k, p, 'b');
      for (int64_t i = 0; i < b.numel(); ++i) b.data<float>()[i] = 0.01f * static_cast<float>(i % 7 - 3);
      adapters.set_part_matrix(k, p, 'b', b);
    }
}

}  // namespace forge::testing
