// ModelConfig's parameter and FLOP accounting; see config.h.
#include "model/config.h"

namespace forge {

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
