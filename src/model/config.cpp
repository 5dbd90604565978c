// ModelConfig's parameter and FLOP accounting; see config.h.
#include "model/config.h"

#include "core/checked_math.h"

namespace forge {
namespace {

// Partial sums and products stay in optional: one overflow anywhere empties the result.
std::optional<int64_t> add(std::optional<int64_t> a, std::optional<int64_t> b) {
  return a && b ? checked_add(*a, *b) : std::nullopt;
}
std::optional<int64_t> mul(std::optional<int64_t> a, std::optional<int64_t> b) {
  return a && b ? checked_mul(*a, *b) : std::nullopt;
}

}  // namespace

std::optional<int64_t> ModelConfig::checked_params_per_layer() const {
  const int64_t h = hidden_size;
  const auto q = mul(num_heads, resolved_head_dim());
  const auto kv = mul(num_kv_heads, resolved_head_dim());
  const auto attention = add(mul(h, add(q, mul(2, kv))), mul(q, h));
  const auto expert = mul(mul(3, h), ffn_hidden_size);
  // A MoE block: num_experts experts and the router's [num_experts, hidden] weight.
  const auto mlp = moe() ? add(mul(num_experts, expert), mul(num_experts, h)) : expert;
  return add(add(attention, mlp), mul(2, h));
}

std::optional<int64_t> ModelConfig::checked_total_params() const {
  const auto embedding = mul(vocab_size, hidden_size);
  const auto output = tie_word_embeddings ? std::optional<int64_t>(0) : embedding;
  return add(add(add(embedding, mul(num_layers, checked_params_per_layer())), hidden_size), output);
}

// validate() refuses a config whose count overflows or exceeds kMaxParams, so after it
// these never fail; a config that skipped validation fails here instead of wrapping.
int64_t ModelConfig::params_per_layer() const {
  const auto n = checked_params_per_layer();
  FORGE_CHECK(n.has_value(), "the parameter count of one layer overflows 64-bit integers (unvalidated model config)");
  return *n;
}

int64_t ModelConfig::total_params() const {
  const auto n = checked_total_params();
  FORGE_CHECK(n.has_value(), "the parameter count overflows 64-bit integers (unvalidated model config)");
  return *n;
}

int64_t ModelConfig::active_params() const {
  const int64_t idle_experts = moe() ? num_experts - num_experts_per_tok : 0;
  return total_params() - num_layers * idle_experts * 3 * hidden_size * ffn_hidden_size;
}

int64_t ModelConfig::embedding_params() const {
  const auto n = checked_mul(vocab_size, hidden_size);
  FORGE_CHECK(n.has_value(), "the embedding's size overflows 64-bit integers (unvalidated model config)");
  return *n;
}

double ModelConfig::flops_per_token(int64_t seq_len) const {
  double dense = 6.0 * static_cast<double>(active_params() - embedding_params());
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
