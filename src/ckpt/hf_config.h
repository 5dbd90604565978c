// Hugging Face config.json ↔ forge's ModelConfig, for Llama, Mistral, Mixtral and
// DeepSeek-V2/V3 checkpoints.
//
// Reading follows what transformers (4.x and 5.x) does with the same file: keys a config
// may omit take LlamaConfig's / MistralConfig's / MixtralConfig's / DeepseekV2Config's /
// DeepseekV3Config's defaults (num_key_value_heads = num_attention_heads, Mixtral's 8;
// head_dim = hidden_size / num_attention_heads; rms_norm_eps 1e-6, Mixtral's 1e-5;
// rope_theta 10000, Mixtral's 1e6; no tied embeddings; Mistral's sliding_window 4096,
// Mixtral's none, null meaning none); RoPE comes from the legacy "rope_scaling" dict if set,
// else transformers 5's "rope_parameters", with rope_theta taken from inside it or from the
// top level. Anything forge would compute differently is refused with the key named: a
// rope_type other than default or llama3 (DeepSeek: default or yarn), biases, an activation
// other than SiLU, router jitter, an architecture other than LlamaForCausalLM,
// MistralForCausalLM, MixtralForCausalLM, DeepseekV2ForCausalLM or DeepseekV3ForCausalLM.
//
// NOTE [Mixtral config keys]
// MixtralForCausalLM is forge's Mixture-of-Experts model (NOTE [MoE feed-forward] in
// model/moe_feed_forward.h): num_local_experts is model.num_experts, num_experts_per_tok
// model.num_experts_per_tok (defaults 8 and 2, as MixtralConfig). transformers adds the
// balancing loss to the training loss only with output_router_logits true, so
// model.router_aux_loss_coef is router_aux_loss_coef then and 0 otherwise (the published
// Mixtral-8x7B has 0.02 with output_router_logits false: forge trains it without the loss
// unless model.router_aux_loss_coef is set, as transformers does). Writing is the reverse:
// output_router_logits is whether the coefficient is above 0, and router_aux_loss_coef is
// written only then; with 0 it is left out, so an export keeps the source's dormant value
// (NOTE [Export keeps the source's config] in hf_export.h) and a model of forge's own gets
// transformers' default, unused while output_router_logits is false.
// router_jitter_noise must be 0 (forge's router has no jitter) and is written as 0. A
// Mixture-of-Experts model without Multi-head Latent Attention is written as Mixtral only
// with Mixtral's routing and experts (softmax, renormalized, unscaled, not group-limited, no
// shared experts, no dense first blocks, the experts' size ffn_hidden_size); anything else
// has no Hugging Face class forge writes and is refused.
//
// NOTE [DeepSeek config keys]
// DeepseekV2ForCausalLM and DeepseekV3ForCausalLM are forge's models with Multi-head Latent
// Attention (NOTE [Multi-head Latent Attention] in model/latent_attention.h), read as
// transformers 5.23's DeepseekV2Config / DeepseekV3Config and modeling code compute them:
//   q_lora_rank (null: queries uncompressed, model.q_lora_rank 0), kv_lora_rank,
//   qk_nope_head_dim, qk_rope_head_dim, v_head_dim     the model.* keys of the same names
//                                                       (defaults 1536, 512, 128, 64, 128)
//   n_routed_experts, num_experts_per_tok               model.num_experts, num_experts_per_tok
//                                                       (V2 64 and no default, V3 256 and 8)
//   moe_intermediate_size, n_shared_experts             model.moe_ffn_hidden_size,
//                                                       num_shared_experts (V2 1407, 2; V3 2048, 1)
//   first_k_dense_replace, intermediate_size            model.first_dense_layers (V2 0, V3 3)
//                                                       and its blocks' ffn_hidden_size; at
//                                                       num_hidden_layers or more every block is
//                                                       dense: a dense model with MLA
//   num_key_value_heads                                 must equal num_attention_heads (V2's
//                                                       default; V3's is 128)
//   rope_scaling / rope_parameters                      "default" or "yarn": factor,
//                                                       original_max_position_embeddings (a
//                                                       top-level one wins, as in transformers),
//                                                       beta_fast, beta_slow (0 or null: 32 and
//                                                       1), mscale, mscale_all_dim; an explicit
//                                                       attention_factor and truncate false are
//                                                       accepted only where they equal what
//                                                       forge computes
// V2 routes on softmax scores, unnormalized (its router never reads norm_topk_prob, which
// must be false where DeepSeek's own code would renormalize, top-k above 1) and scaled by
// routed_scaling_factor (default 1; the 236B models' 16); topk_method "greedy" with n_group
// and topk_group 1 or null, or "group_limited_greedy" (the 236B models': n_group and
// topk_group required, each group ranked by its largest probability). V3 routes
// on sigmoid scores plus e_score_correction_bias, group-limited (n_group, topk_group;
// defaults 8 and 4), renormalized with norm_topk_prob (default true) and scaled by
// routed_scaling_factor (default 2.5). DeepSeek's own keys that transformers ignores are
// checked against what it computes: scoring_func (V2 "softmax", V3 "sigmoid"), topk_method
// (V3 "noaux_tc") and moe_layer_freq (1: every block after the dense ones is MoE). Neither
// class computes a balancing loss (aux_loss_alpha, seq_aux and output_router_logits change
// nothing there), so model.router_aux_loss_coef is 0; ep_size, head_dim and qk_head_dim
// (derived) are ignored as transformers ignores them. DeepSeek rotates interleaved pairs of
// the rotary rows, which import reorders (HfTensor::rotary_rows in model/parameters.h),
// except under V3's rope_interleave false, where the rows are rotate-half already
// (HfWeightLayout). A checkpoint with a quantization_config (DeepSeek-V3's FP8) is refused.
// Writing gives a model with MLA DeepseekV3ForCausalLM when it routes on sigmoid scores and
// DeepseekV2ForCausalLM otherwise (a dense one: first_k_dense_replace = num_hidden_layers),
// with the keys transformers 5 writes, plus rope_theta / rope_scaling (with "type") /
// torch_dtype and DeepSeek's own scoring_func, topk_method and moe_layer_freq, which its
// reference code and other readers use; num_nextn_predict_layers is 0 (forge writes no
// multi-token-prediction blocks). Shared experts or dense first blocks without MLA have no
// Hugging Face class forge writes and are refused.
//
// Writing produces the config.json that transformers 5 writes for the same model
// (rope_parameters, dtype), as the family asked for (the source model's, so a Mistral with
// "sliding_window": null stays Mistral; without one, MistralForCausalLM only when a
// sliding window is set; a Mixture-of-Experts model without MLA is always MixtralForCausalLM),
// plus the same facts under the older names (rope_theta, rope_scaling, torch_dtype) that
// transformers 4.x and other readers use; transformers 5 accepts both without warnings.
//
// A model read from a directory is named after it (hf_model_name): the directory's name,
// or for a snapshot in the Hugging Face hub cache (.../models--ORG--NAME/snapshots/REV),
// NAME, so runs, logs and reports say which model they trained.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"

namespace forge {

// Maps a parsed config.json; `path` names it in errors. The result is validated.
ModelConfig model_config_from_hf(const nlohmann::json& config, const std::string& path);
// Reads and maps DIR/config.json; the model is named hf_model_name(dir).
ModelConfig read_hf_config(const std::string& dir);

// True when DIR holds a config.json (what makes a directory a Hugging Face model to forge).
bool is_hf_model_dir(const std::string& dir);

// The model's name for DIR (see above).
std::string hf_model_name(const std::string& dir);

// "llama", "mistral", "mixtral", "deepseek_v2" or "deepseek_v3", from a parsed
// config.json's "architectures" (or "model_type"); anything else fails naming `path`.
std::string hf_model_family(const nlohmann::json& config, const std::string& path);

// What a config.json says about its weight files beyond the architecture (NOTE [DeepSeek
// config keys]).
struct HfWeightLayout {
  // DeepSeek's rotary rows are in interleaved pairs, which import and export reorder
  // (HfTensor::rotary_rows); false under DeepSeek-V3's rope_interleave false.
  bool interleaved_rotary = true;
  // DeepSeek-V3's multi-token-prediction blocks (num_nextn_predict_layers), stored as blocks
  // num_hidden_layers and on: transformers does not load them (it drops model.layers.61.*),
  // nor does forge, which does not train them.
  int64_t extra_layers = 0;
};
HfWeightLayout hf_weight_layout(const nlohmann::json& config, const std::string& path);

// The torch dtype name ("float32", "bfloat16", "float16") a parsed config.json declares in
// "dtype" (transformers 5) or "torch_dtype" (4.x); empty when it declares none.
std::string hf_declared_dtype(const nlohmann::json& config, const std::string& path);

// config.json for `config`, with torch dtype name `dtype` ("float32", "bfloat16" or
// "float16"), as `family` ("llama", "mistral", "mixtral", "deepseek_v2", "deepseek_v3";
// empty: with Multi-head Latent Attention deepseek_v3 for sigmoid routing, else
// deepseek_v2; without, mixtral exactly for a Mixture-of-Experts model, else mistral
// exactly when a sliding window is set; a family must agree with the model). A Mistral or
// Mixtral without a window gets "sliding_window": null. `layout` says how the weights are
// stored (DeepSeek-V3's rope_interleave). A model no Hugging Face class computes (NOTE
// [Mixtral config keys], [DeepSeek config keys]) fails, saying why.
nlohmann::ordered_json hf_config_from_model(const ModelConfig& config, const std::string& dtype,
                                            const std::string& family = "", const HfWeightLayout& layout = {});

}  // namespace forge
