// ModelConfig::validate: every rule a model architecture must satisfy, each written once
// and reported through the caller's KeyDescriber (NOTE [Config rules name their keys
// through the caller] in core/config_check.h). The single-key bounds come first, so the
// relations below never divide by zero.
#include "model/config_rules.h"

#include <string>
#include <utility>

#include "model/config.h"

namespace forge {
namespace {

// A key that only means something with a feature must keep its default without it, so that
// a key set by mistake is not silently ignored; `without` says what is missing.
template <typename T>
void keep_default(const KeyDescriber& keys, const char* key, const T& value, const T& fallback, const char* without) {
  if (value != fallback) FORGE_FAIL("{} {}", keys.describe(key, value), without);
}

}  // namespace

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
  check_moe_rules(keys);
  check_mla_rules(keys);

  if (num_heads % num_kv_heads != 0)
    FORGE_FAIL("{} must be divisible by {}", keys.describe("model.num_heads", num_heads),
               keys.describe("model.num_kv_heads", num_kv_heads));
  if (!mla() && head_dim == 0 && hidden_size % num_heads != 0)
    FORGE_FAIL("{} must be divisible by {} when model.head_dim is not given",
               keys.describe("model.hidden_size", hidden_size), keys.describe("model.num_heads", num_heads));
  if (!mla() && resolved_head_dim() % 2 != 0) {
    const std::string source = head_dim > 0 ? keys.describe("model.head_dim", head_dim)
                                            : keys.describe("model.hidden_size", hidden_size) + " / " +
                                                  keys.describe("model.num_heads", num_heads);
    FORGE_FAIL("the head size must be even for rotary embeddings, got {} from {}", resolved_head_dim(), source);
  }
  check_choice(keys, "model.rope_scaling.type", rope_scaling.type, model_bounds::rope_scaling_types);
  check_range(keys, "model.rope_scaling.beta_fast", rope_scaling.beta_fast, model_bounds::rope_scaling_beta);
  check_range(keys, "model.rope_scaling.beta_slow", rope_scaling.beta_slow, model_bounds::rope_scaling_beta);
  check_range(keys, "model.rope_scaling.mscale", rope_scaling.mscale, model_bounds::rope_scaling_mscale);
  check_range(keys, "model.rope_scaling.mscale_all_dim", rope_scaling.mscale_all_dim,
              model_bounds::rope_scaling_mscale);
  if (rope_scaling.yarn() && !(rope_scaling.beta_fast > rope_scaling.beta_slow))
    FORGE_FAIL("{} must be greater than {} (YaRN's ramp runs from the fast to the slow bound)",
               keys.describe("model.rope_scaling.beta_fast", rope_scaling.beta_fast),
               keys.describe("model.rope_scaling.beta_slow", rope_scaling.beta_slow));
  if (rope_scaling.enabled && rope_scaling.type == "llama3" &&
      !(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor))
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
    FORGE_FAIL("{}, {}, {}, {}, {}, {}, {}, {}, {} and {} give {}: forge supports at most {} (2^50) parameters",
               keys.describe("model.vocab_size", vocab_size), keys.describe("model.hidden_size", hidden_size),
               keys.describe("model.num_layers", num_layers), keys.describe("model.num_heads", num_heads),
               keys.describe("model.num_kv_heads", num_kv_heads), keys.describe("model.head_dim", head_dim),
               keys.describe("model.ffn_hidden_size", ffn_hidden_size),
               keys.describe("model.num_experts", num_experts),
               keys.describe("model.moe_ffn_hidden_size", moe_ffn_hidden_size),
               keys.describe("model.kv_lora_rank", kv_lora_rank),
               params ? fmt::format("{} parameters", *params) : "a parameter count that overflows 64-bit integers",
               kMaxParams);
}

// The Mixture-of-Experts keys beyond the expert count and top-k (NOTE [MoE feed-forward]).
void ModelConfig::check_moe_rules(const KeyDescriber& keys) const {
  check_range(keys, "model.moe_ffn_hidden_size", moe_ffn_hidden_size, model_bounds::moe_ffn_hidden_size);
  check_range(keys, "model.num_shared_experts", num_shared_experts, model_bounds::num_shared_experts);
  check_range(keys, "model.first_dense_layers", first_dense_layers, model_bounds::first_dense_layers);
  check_range(keys, "model.router_scaling_factor", router_scaling_factor, model_bounds::router_scaling_factor);
  check_range(keys, "model.router_num_groups", router_num_groups, model_bounds::router_num_groups);
  check_range(keys, "model.router_topk_groups", router_topk_groups, model_bounds::router_topk_groups);
  check_range(keys, "model.router_bias_update_rate", router_bias_update_rate, model_bounds::router_bias_update_rate);
  check_choice(keys, "model.router_score_function", router_score_function, model_bounds::router_score_functions);
  check_choice(keys, "model.router_aux_loss_type", router_aux_loss_type, model_bounds::router_aux_loss_types);
  check_range(keys, "model.router_z_loss_coef", router_z_loss_coef, model_bounds::router_z_loss_coef);
  check_range(keys, "model.moe_capacity_factor", moe_capacity_factor, model_bounds::moe_capacity_factor);
  check_choice(keys, "model.moe_token_drop_policy", moe_token_drop_policy, model_bounds::moe_token_drop_policies);
  if (!moe()) {
    const char* dense = "needs model.num_experts > 0 (a Mixture-of-Experts model); it is 0, a dense model";
    keep_default(keys, "model.moe_ffn_hidden_size", moe_ffn_hidden_size, int64_t{0}, dense);
    keep_default(keys, "model.num_shared_experts", num_shared_experts, int64_t{0}, dense);
    keep_default(keys, "model.first_dense_layers", first_dense_layers, int64_t{0}, dense);
    keep_default(keys, "model.router_score_function", router_score_function, std::string("softmax"), dense);
    keep_default(keys, "model.router_num_groups", router_num_groups, int64_t{1}, dense);
    keep_default(keys, "model.router_topk_groups", router_topk_groups, int64_t{1}, dense);
    keep_default(keys, "model.router_scaling_factor", router_scaling_factor, 1.0, dense);
    keep_default(keys, "model.router_bias_update_rate", router_bias_update_rate, 0.0, dense);
    keep_default(keys, "model.router_aux_loss_type", router_aux_loss_type, std::string("pooled"), dense);
    keep_default(keys, "model.router_z_loss_coef", router_z_loss_coef, 0.0, dense);
    keep_default(keys, "model.moe_capacity_factor", moe_capacity_factor, 0.0, dense);
    keep_default(keys, "model.moe_token_drop_policy", moe_token_drop_policy, std::string("probs"), dense);
    keep_default(keys, "model.moe_pad_to_capacity", moe_pad_to_capacity, false, dense);
    return;
  }
  if (first_dense_layers >= num_layers)
    FORGE_FAIL("{} must be less than {}: a Mixture-of-Experts model has at least one MoE block",
               keys.describe("model.first_dense_layers", first_dense_layers),
               keys.describe("model.num_layers", num_layers));
  if (num_experts % router_num_groups != 0)
    FORGE_FAIL("{} must divide {} (the experts form equal groups)",
               keys.describe("model.router_num_groups", router_num_groups),
               keys.describe("model.num_experts", num_experts));
  if (router_topk_groups > router_num_groups)
    FORGE_FAIL("{} must be at most {}", keys.describe("model.router_topk_groups", router_topk_groups),
               keys.describe("model.router_num_groups", router_num_groups));
  if (router_topk_groups * (num_experts / router_num_groups) < num_experts_per_tok)
    FORGE_FAIL("{} groups of {} experts cannot hold {} choices", keys.describe("model.router_topk_groups", router_topk_groups),
               num_experts / router_num_groups, keys.describe("model.num_experts_per_tok", num_experts_per_tok));
  if (router_score_function == "sigmoid" && router_num_groups > 1 && num_experts / router_num_groups < 2)
    FORGE_FAIL("{} leaves groups of {} expert; sigmoid routing ranks a group by its two best scores",
               keys.describe("model.router_num_groups", router_num_groups), num_experts / router_num_groups);
  if (router_bias_update_rate != 0.0 && router_score_function != "sigmoid")
    FORGE_FAIL("{} needs model.router_score_function sigmoid (the routing bias is sigmoid routing's); it is {}",
               keys.describe("model.router_bias_update_rate", router_bias_update_rate), router_score_function);
  if (router_score_function == "sigmoid" && router_aux_loss_coef != 0.0)
    FORGE_FAIL("{} with {}: the Switch balancing loss is for softmax routing",
               keys.describe("model.router_aux_loss_coef", router_aux_loss_coef),
               keys.describe("model.router_score_function", router_score_function));
  if (router_aux_loss_type != "pooled" && router_aux_loss_coef == 0.0)
    FORGE_FAIL("{} needs model.router_aux_loss_coef > 0 (it chooses which balancing loss that weighs); it is 0",
               keys.describe("model.router_aux_loss_type", router_aux_loss_type));
  // NOTE [MoE capacity] in ops/moe.h: the policy and the padding only mean something with a
  // capacity, so without one they must keep their defaults.
  if (moe_capacity_factor == 0.0 && moe_token_drop_policy != "probs")
    FORGE_FAIL("{} needs model.moe_capacity_factor > 0 (it chooses which assignments an expert over its capacity "
               "drops); it is 0, dropless routing",
               keys.describe("model.moe_token_drop_policy", moe_token_drop_policy));
  if (moe_capacity_factor == 0.0 && moe_pad_to_capacity)
    FORGE_FAIL("{} needs model.moe_capacity_factor > 0 (each expert's rows are padded to its capacity); it is 0, "
               "dropless routing",
               keys.describe("model.moe_pad_to_capacity", moe_pad_to_capacity));
}

// Multi-head Latent Attention's keys (NOTE [Multi-head Latent Attention]).
void ModelConfig::check_mla_rules(const KeyDescriber& keys) const {
  check_range(keys, "model.q_lora_rank", q_lora_rank, model_bounds::q_lora_rank);
  check_range(keys, "model.kv_lora_rank", kv_lora_rank, model_bounds::kv_lora_rank);
  check_range(keys, "model.qk_nope_head_dim", qk_nope_head_dim, model_bounds::qk_nope_head_dim);
  check_range(keys, "model.qk_rope_head_dim", qk_rope_head_dim, model_bounds::qk_rope_head_dim);
  check_range(keys, "model.v_head_dim", v_head_dim, model_bounds::v_head_dim);
  if (!mla()) {
    const char* gqa = "needs model.kv_lora_rank > 0 (Multi-head Latent Attention); it is 0, grouped-query attention";
    keep_default(keys, "model.q_lora_rank", q_lora_rank, int64_t{0}, gqa);
    keep_default(keys, "model.qk_nope_head_dim", qk_nope_head_dim, int64_t{0}, gqa);
    keep_default(keys, "model.qk_rope_head_dim", qk_rope_head_dim, int64_t{0}, gqa);
    keep_default(keys, "model.v_head_dim", v_head_dim, int64_t{0}, gqa);
    return;
  }
  if (qk_nope_head_dim < 1 || v_head_dim < 1)
    FORGE_FAIL("{} and {} must be at least 1 with Multi-head Latent Attention ({})",
               keys.describe("model.qk_nope_head_dim", qk_nope_head_dim), keys.describe("model.v_head_dim", v_head_dim),
               keys.describe("model.kv_lora_rank", kv_lora_rank));
  if (qk_rope_head_dim < 2 || qk_rope_head_dim % 2 != 0)
    FORGE_FAIL("{} must be even and at least 2 (the rotary part of each query/key head)",
               keys.describe("model.qk_rope_head_dim", qk_rope_head_dim));
  if (num_kv_heads != num_heads)
    FORGE_FAIL("{} must equal {} with Multi-head Latent Attention (every head has its own key and value)",
               keys.describe("model.num_kv_heads", num_kv_heads), keys.describe("model.num_heads", num_heads));
  if (sliding_window != 0)
    FORGE_FAIL("{}: Multi-head Latent Attention has no sliding window; set it to 0",
               keys.describe("model.sliding_window", sliding_window));
}

}  // namespace forge
