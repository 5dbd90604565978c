// ModelConfig's parameter and FLOP accounting; see config.h.
#include "model/config.h"

#include <algorithm>

#include "core/checked_math.h"

namespace forge {
namespace {

// Partial sums and products stay in optional: one overflow anywhere empties the result.
std::optional<int64_t> add(std::optional<int64_t> a, std::optional<int64_t> b) { return checked_add(a, b); }
std::optional<int64_t> mul(std::optional<int64_t> a, std::optional<int64_t> b) { return checked_mul(a, b); }

}  // namespace

std::optional<int64_t> ModelConfig::checked_layer_params(int64_t layer) const {
  const int64_t h = hidden_size;
  std::optional<int64_t> attention;
  if (mla()) {  // NOTE [Multi-head Latent Attention] in model/latent_attention.h
    const auto q_width = mul(num_heads, qk_head_dim());
    const auto q = q_lora_rank > 0 ? add(add(mul(h, q_lora_rank), q_lora_rank), mul(q_lora_rank, q_width))
                                    : mul(h, q_width);
    const auto kv = add(add(mul(h, add(kv_lora_rank, qk_rope_head_dim)), kv_lora_rank),
                        mul(kv_lora_rank, mul(num_heads, add(qk_nope_head_dim, v_head_dim))));
    attention = add(add(q, kv), mul(mul(num_heads, v_head_dim), h));
  } else {
    const auto q = mul(num_heads, resolved_head_dim());
    const auto kv = mul(num_kv_heads, resolved_head_dim());
    attention = add(mul(h, add(q, mul(2, kv))), mul(q, h));
  }
  // A MoE block: its routed experts, the router's [num_experts, hidden] weight (and with
  // sigmoid routing its [num_experts] bias) and the shared experts' one SwiGLU; a dense block
  // one SwiGLU of ffn_hidden_size.
  const int64_t router_rows = router_score_function == "sigmoid" ? h + 1 : h;
  const auto mlp = moe_layer(layer) ? add(add(mul(num_experts, mul(mul(3, h), resolved_moe_ffn())),
                                              mul(num_experts, router_rows)),
                                          mul(mul(3, h), mul(num_shared_experts, resolved_moe_ffn())))
                                    : mul(mul(3, h), ffn_hidden_size);
  return add(add(attention, mlp), mul(2, h));
}

std::optional<int64_t> ModelConfig::checked_total_params() const {
  const auto embedding = mul(vocab_size, hidden_size);
  const auto output = tie_word_embeddings ? std::optional<int64_t>(0) : embedding;
  // Blocks come in two kinds at most: the dense first ones and the rest.
  const int64_t dense = moe() ? std::min(first_dense_layers, num_layers) : num_layers;
  std::optional<int64_t> blocks = 0;
  if (dense > 0) blocks = add(blocks, mul(dense, checked_layer_params(0)));
  if (dense < num_layers) blocks = add(blocks, mul(num_layers - dense, checked_layer_params(num_layers - 1)));
  return add(add(add(embedding, blocks), hidden_size), output);
}

// validate() refuses a config whose count overflows or exceeds kMaxParams, so after it
// these never fail; a config that skipped validation fails here instead of wrapping.
int64_t ModelConfig::layer_params(int64_t layer) const {
  const auto n = checked_layer_params(layer);
  FORGE_CHECK(n.has_value(), "the parameter count of one layer overflows 64-bit integers (unvalidated model config)");
  return *n;
}

int64_t ModelConfig::largest_layer_params() const {
  return std::max(layer_params(0), layer_params(num_layers - 1));
}

int64_t ModelConfig::total_params() const {
  const auto n = checked_total_params();
  FORGE_CHECK(n.has_value(), "the parameter count overflows 64-bit integers (unvalidated model config)");
  return *n;
}

int64_t ModelConfig::active_params() const {
  int64_t idle = 0;  // the routed experts a token does not use, in every MoE block
  for (int64_t i = 0; i < num_layers; ++i)
    if (moe_layer(i)) idle += (num_experts - num_experts_per_tok) * 3 * hidden_size * resolved_moe_ffn();
  return total_params() - idle;
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
  const double width = mla() ? static_cast<double>(num_heads) * static_cast<double>(qk_head_dim() + v_head_dim) / 2.0
                             : static_cast<double>(hidden_size);
  double attention = 6.0 * static_cast<double>(num_layers) * width * static_cast<double>(seq_len);
  return dense + attention;
}

}  // namespace forge
