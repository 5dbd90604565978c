// Hugging Face config.json ↔ forge's ModelConfig, for Llama and Mistral checkpoints.
//
// Reading follows what transformers (4.x and 5.x) does with the same file: keys a config
// may omit take LlamaConfig's / MistralConfig's defaults (num_key_value_heads =
// num_attention_heads, head_dim = hidden_size / num_attention_heads, rms_norm_eps 1e-6,
// no tied embeddings, Mistral's sliding_window 4096, null meaning none); RoPE comes from
// the legacy "rope_scaling" dict if set, else transformers 5's "rope_parameters", with
// rope_theta taken from inside it or from the top level. Anything forge would compute
// differently is refused with the key named: a rope_type other than default or llama3,
// biases, an activation other than SiLU, an architecture other than LlamaForCausalLM or
// MistralForCausalLM.
//
// Writing produces the config.json that transformers 5 writes for the same model
// (rope_parameters, dtype), choosing MistralForCausalLM only when a sliding window is set,
// plus the same facts under the older names (rope_theta, rope_scaling, torch_dtype) that
// transformers 4.x and other readers use; transformers 5 accepts both without warnings.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"

namespace forge {

// Maps a parsed config.json; `path` names it in errors. The result is validated.
ModelConfig model_config_from_hf(const nlohmann::json& config, const std::string& path);
// Reads and maps DIR/config.json.
ModelConfig read_hf_config(const std::string& dir);

// config.json for `config`, with torch dtype name `dtype` ("float32" or "bfloat16").
nlohmann::ordered_json hf_config_from_model(const ModelConfig& config, const std::string& dtype);

}  // namespace forge
