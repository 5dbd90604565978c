#include "model/config.h"

#include "core/error.h"

namespace forge {

void ModelConfig::validate() const {
  auto positive = [&](int64_t v, const char* key) {
    if (v < 1) FORGE_FAIL("model.{} must be >= 1, got {} (model '{}')", key, v, name);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_layers, "num_layers");
  positive(num_heads, "num_heads");
  positive(num_kv_heads, "num_kv_heads");
  positive(ffn_hidden_size, "ffn_hidden_size");
  positive(max_seq_len, "max_seq_len");
  if (num_heads % num_kv_heads != 0)
    FORGE_FAIL("model.num_heads ({}) must be a multiple of model.num_kv_heads ({})", num_heads, num_kv_heads);
  if (head_dim == 0 && hidden_size % num_heads != 0)
    FORGE_FAIL("model.hidden_size ({}) must be divisible by model.num_heads ({}) unless model.head_dim is set",
               hidden_size, num_heads);
  if (head_dim < 0) FORGE_FAIL("model.head_dim must be >= 0 (0: hidden_size / num_heads), got {}", head_dim);
  if (resolved_head_dim() % 2 != 0)
    FORGE_FAIL("head dimension must be even for rotary embeddings, got {}", resolved_head_dim());
  if (!(norm_eps > 0)) FORGE_FAIL("model.norm_eps must be > 0, got {}", norm_eps);
  if (!(rope_theta > 0)) FORGE_FAIL("model.rope_theta must be > 0, got {}", rope_theta);
  if (sliding_window < 0) FORGE_FAIL("model.sliding_window must be >= 0 (0: none), got {}", sliding_window);
  if (!(init_std > 0)) FORGE_FAIL("model.init_std must be > 0, got {}", init_std);
  if (rope_scaling.enabled) {
    if (!(rope_scaling.factor >= 1)) FORGE_FAIL("model.rope_scaling.factor must be >= 1, got {}", rope_scaling.factor);
    if (!(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor))
      FORGE_FAIL("model.rope_scaling.high_freq_factor ({}) must exceed model.rope_scaling.low_freq_factor ({})",
                 rope_scaling.high_freq_factor, rope_scaling.low_freq_factor);
    if (rope_scaling.original_max_position < 1)
      FORGE_FAIL("model.rope_scaling.original_max_position must be >= 1, got {}", rope_scaling.original_max_position);
  }
}

int64_t ModelConfig::params_per_layer() const {
  int64_t h = hidden_size;
  int64_t attention = h * (q_size() + 2 * kv_size()) + q_size() * h;
  int64_t mlp = 3 * h * ffn_hidden_size;
  int64_t norms = 2 * h;
  return attention + mlp + norms;
}

int64_t ModelConfig::total_params() const {
  int64_t output = tie_word_embeddings ? 0 : vocab_size * hidden_size;
  return embedding_params() + num_layers * params_per_layer() + hidden_size + output;
}

double ModelConfig::flops_per_token(int64_t seq_len) const {
  double dense = 6.0 * static_cast<double>(total_params() - embedding_params());
  // NOTE [Tied embeddings in the FLOP count]
  // With tied weights the output projection still does a V x H matmul per token, but the
  // matrix is counted under "input embedding"; add it back so tied models are not credited
  // with less work than they do.
  if (tie_word_embeddings) dense += 6.0 * static_cast<double>(vocab_size * hidden_size);
  double attention = 6.0 * static_cast<double>(num_layers) * static_cast<double>(hidden_size) *
                     static_cast<double>(seq_len);
  return dense + attention;
}

}  // namespace forge
