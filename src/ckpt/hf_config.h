// Hugging Face config.json ↔ forge's ModelConfig, for Llama, Mistral and Mixtral checkpoints.
//
// Reading follows what transformers (4.x and 5.x) does with the same file: keys a config
// may omit take LlamaConfig's / MistralConfig's / MixtralConfig's defaults
// (num_key_value_heads = num_attention_heads, Mixtral's 8; head_dim = hidden_size /
// num_attention_heads; rms_norm_eps 1e-6, Mixtral's 1e-5; rope_theta 10000, Mixtral's 1e6;
// no tied embeddings; Mistral's sliding_window 4096, Mixtral's none, null meaning none);
// RoPE comes from the legacy "rope_scaling" dict if set, else transformers 5's
// "rope_parameters", with rope_theta taken from inside it or from the top level. Anything
// forge would compute differently is refused with the key named: a rope_type other than
// default or llama3, biases, an activation other than SiLU, router jitter, an architecture
// other than LlamaForCausalLM, MistralForCausalLM or MixtralForCausalLM.
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
// router_jitter_noise must be 0 (forge's router has no jitter) and is written as 0.
//
// Writing produces the config.json that transformers 5 writes for the same model
// (rope_parameters, dtype), as the family asked for (the source model's, so a Mistral with
// "sliding_window": null stays Mistral; without one, MistralForCausalLM only when a
// sliding window is set; a Mixture-of-Experts model is always MixtralForCausalLM), plus
// the same facts under the older names (rope_theta, rope_scaling, torch_dtype) that
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

// "llama", "mistral" or "mixtral", from a parsed config.json's "architectures" (or
// "model_type"); anything else fails naming `path`.
std::string hf_model_family(const nlohmann::json& config, const std::string& path);

// The torch dtype name ("float32", "bfloat16", "float16") a parsed config.json declares in
// "dtype" (transformers 5) or "torch_dtype" (4.x); empty when it declares none.
std::string hf_declared_dtype(const nlohmann::json& config, const std::string& path);

// config.json for `config`, with torch dtype name `dtype` ("float32", "bfloat16" or
// "float16"), as `family` ("llama", "mistral", "mixtral"; empty: mixtral exactly for a
// Mixture-of-Experts model, else mistral exactly when a sliding window is set; a family
// must agree with whether the model is MoE). A Mistral or Mixtral without a window gets
// "sliding_window": null.
nlohmann::ordered_json hf_config_from_model(const ModelConfig& config, const std::string& dtype,
                                            const std::string& family = "");

}  // namespace forge
