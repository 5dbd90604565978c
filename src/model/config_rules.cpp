// ModelConfig::validate: every rule a model architecture must satisfy, each written once
// and reported through the caller's KeyDescriber (NOTE [Config rules name their keys
// through the caller] in core/config_check.h). The single-key bounds come first, so the
// relations below never divide by zero.
#include "model/config_rules.h"

#include <string>

#include "model/config.h"

namespace forge {

void ModelConfig::validate(const KeyDescriber& keys) const {
  check_range(keys, "model.vocab_size", vocab_size, model_bounds::vocab_size);
  check_range(keys, "model.hidden_size", hidden_size, model_bounds::hidden_size);
  check_range(keys, "model.num_layers", num_layers, model_bounds::num_layers);
  check_range(keys, "model.num_heads", num_heads, model_bounds::num_heads);
  check_range(keys, "model.num_kv_heads", num_kv_heads, model_bounds::num_kv_heads);
  check_range(keys, "model.head_dim", head_dim, model_bounds::head_dim);
  check_range(keys, "model.ffn_hidden_size", ffn_hidden_size, model_bounds::ffn_hidden_size);
  check_range(keys, "model.norm_eps", norm_eps, model_bounds::norm_eps);
  check_range(keys, "model.rope_theta", rope_theta, model_bounds::rope_theta);
  check_range(keys, "model.rope_scaling.factor", rope_scaling.factor, model_bounds::rope_scaling_factor);
  check_range(keys, "model.rope_scaling.low_freq_factor", rope_scaling.low_freq_factor,
              model_bounds::rope_scaling_low_freq_factor);
  check_range(keys, "model.rope_scaling.high_freq_factor", rope_scaling.high_freq_factor,
              model_bounds::rope_scaling_high_freq_factor);
  check_range(keys, "model.rope_scaling.original_max_position", rope_scaling.original_max_position,
              model_bounds::rope_scaling_original_max_position);
  check_range(keys, "model.max_seq_len", max_seq_len, model_bounds::max_seq_len);
  check_range(keys, "model.sliding_window", sliding_window, model_bounds::sliding_window);
  check_range(keys, "model.init_std", init_std, model_bounds::init_std);
  check_range(keys, "model.num_experts", num_experts, model_bounds::num_experts);
  check_range(keys, "model.num_experts_per_tok", num_experts_per_tok, model_bounds::num_experts_per_tok);
  if (moe() && (num_experts_per_tok < 1 || num_experts_per_tok > num_experts))
    FORGE_FAIL("{} must be between 1 and {} (each token is routed to that many experts)",
               keys.describe("model.num_experts_per_tok", num_experts_per_tok),
               keys.describe("model.num_experts", num_experts));
  check_range(keys, "model.router_aux_loss_coef", router_aux_loss_coef, model_bounds::router_aux_loss_coef);
  if (!moe() && router_aux_loss_coef != 0.0)
    FORGE_FAIL("{} needs model.num_experts > 0 (a Mixture-of-Experts model); it is 0, a dense model",
               keys.describe("model.router_aux_loss_coef", router_aux_loss_coef));
  if (!moe() && num_experts_per_tok != 0)
    FORGE_FAIL("{} needs model.num_experts > 0 (a Mixture-of-Experts model); it is 0, a dense model",
               keys.describe("model.num_experts_per_tok", num_experts_per_tok));

  if (num_heads % num_kv_heads != 0)
    FORGE_FAIL("{} must be divisible by {}", keys.describe("model.num_heads", num_heads),
               keys.describe("model.num_kv_heads", num_kv_heads));
  if (head_dim == 0 && hidden_size % num_heads != 0)
    FORGE_FAIL("{} must be divisible by {} when model.head_dim is not given",
               keys.describe("model.hidden_size", hidden_size), keys.describe("model.num_heads", num_heads));
  if (resolved_head_dim() % 2 != 0) {
    const std::string source = head_dim > 0 ? keys.describe("model.head_dim", head_dim)
                                            : keys.describe("model.hidden_size", hidden_size) + " / " +
                                                  keys.describe("model.num_heads", num_heads);
    FORGE_FAIL("the head size must be even for rotary embeddings, got {} from {}", resolved_head_dim(), source);
  }
  if (rope_scaling.enabled && !(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor))
    FORGE_FAIL("{} must be greater than {} when model.rope_scaling.enabled is true",
               keys.describe("model.rope_scaling.high_freq_factor", rope_scaling.high_freq_factor),
               keys.describe("model.rope_scaling.low_freq_factor", rope_scaling.low_freq_factor));

  // NOTE [Model sizes are checked before use]
  // Every size forge derives from the architecture (parameter counts, memory estimates,
  // buffer lengths) is a product of these keys. Each is bounded alone above, and the total
  // parameter count, computed with overflow checks, must stay under kMaxParams: past this
  // point those products fit in int64_t and the memory check sees a real number.
  const std::optional<int64_t> params = checked_total_params();
  if (!params || *params > kMaxParams)
    FORGE_FAIL("{}, {}, {}, {}, {}, {}, {} and {} give {}: forge supports at most {} (2^50) parameters",
               keys.describe("model.vocab_size", vocab_size), keys.describe("model.hidden_size", hidden_size),
               keys.describe("model.num_layers", num_layers), keys.describe("model.num_heads", num_heads),
               keys.describe("model.num_kv_heads", num_kv_heads), keys.describe("model.head_dim", head_dim),
               keys.describe("model.ffn_hidden_size", ffn_hidden_size),
               keys.describe("model.num_experts", num_experts),
               params ? fmt::format("{} parameters", *params) : "a parameter count that overflows 64-bit integers",
               kMaxParams);
}

}  // namespace forge
