// The allowed values of ModelConfig's keys, each bound written once: ModelConfig::validate
// (model/config_rules.cpp, with the rules that relate several keys) checks them, and the
// cli's schema reads them to reject a bad value where it is set and to say in --help what
// a key accepts.
#pragma once

#include <string>
#include <vector>

#include "core/config_check.h"

namespace forge::model_bounds {

inline constexpr ValueRange vocab_size = {1, 2147483647};  // token ids are int32
inline constexpr ValueRange hidden_size = at_least(1);
// Per-layer bookkeeping (the activation plan) is built before the memory check can refuse
// a config: the bound keeps it small. The deepest models today have about 130 layers.
inline constexpr ValueRange num_layers = {1, 65536};
inline constexpr ValueRange num_heads = at_least(1);
inline constexpr ValueRange num_kv_heads = at_least(1);
inline constexpr ValueRange head_dim = at_least(0);  // 0: hidden_size / num_heads
inline constexpr ValueRange ffn_hidden_size = at_least(1);
inline constexpr ValueRange norm_eps = above(0);
inline constexpr ValueRange rope_theta = above(0);
inline constexpr ValueRange rope_scaling_factor = at_least(1);
inline constexpr ValueRange rope_scaling_low_freq_factor = above(0);
inline constexpr ValueRange rope_scaling_high_freq_factor = above(0);
inline constexpr ValueRange rope_scaling_original_max_position = at_least(1);
inline constexpr ValueRange max_seq_len = at_least(1);
inline constexpr ValueRange sliding_window = at_least(0);  // 0: full causal attention
inline constexpr ValueRange init_std = above(0);
inline constexpr ValueRange num_experts = {0, 65536};  // 0: a dense model
inline constexpr ValueRange num_experts_per_tok = {0, 65536};
inline constexpr ValueRange router_aux_loss_coef = at_least(0);
inline constexpr ValueRange router_z_loss_coef = at_least(0);
inline constexpr ValueRange moe_capacity_factor = at_least(0);  // 0: dropless
inline constexpr ValueRange moe_ffn_hidden_size = at_least(0);  // 0: ffn_hidden_size
inline constexpr ValueRange num_shared_experts = {0, 65536};
inline constexpr ValueRange first_dense_layers = {0, 65536};
inline constexpr ValueRange router_scaling_factor = above(0);
inline constexpr ValueRange router_bias_update_rate = at_least(0);
inline constexpr ValueRange router_num_groups = {1, 65536};
inline constexpr ValueRange router_topk_groups = {1, 65536};
inline constexpr ValueRange q_lora_rank = at_least(0);   // 0: queries projected directly
inline constexpr ValueRange kv_lora_rank = at_least(0);  // 0: grouped-query attention, not MLA
inline constexpr ValueRange qk_nope_head_dim = at_least(0);
inline constexpr ValueRange qk_rope_head_dim = at_least(0);
inline constexpr ValueRange v_head_dim = at_least(0);
inline constexpr ValueRange rope_scaling_beta = above(0);
inline constexpr ValueRange rope_scaling_mscale = at_least(0);  // 0: not set
inline const std::vector<std::string> rope_scaling_types = {"llama3", "yarn"};
inline const std::vector<std::string> router_score_functions = {"softmax", "sigmoid"};
inline const std::vector<std::string> router_aux_loss_types = {"pooled", "per_layer", "sequence", "global"};
inline const std::vector<std::string> moe_token_drop_policies = {"probs", "position"};

}  // namespace forge::model_bounds
