// The lora section: LoRA fine-tuning (NOTE [LoRA training] in model/lora.h), with PEFT's
// and torchtune's names for the adapted modules. rank 0 is ordinary full training.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/config_check.h"

namespace forge {

struct LoraConfig {
  int64_t rank = 0;                           // r; 0: no adapters (full training)
  double alpha = 16.0;                        // the update is scaled by alpha / rank
  double dropout = 0.0;                       // dropout on the adapters' input (PEFT's lora_dropout)
  std::string target_modules = "q_proj,v_proj";  // comma-separated module names, or all-linear
  std::string adapter_path;                   // a PEFT adapter directory to continue training from
  std::string quantize_base = "none";         // none | nf4: the frozen base projections stored as NF4 (QLoRA,
                                              // NOTE [NF4 base weights] in model/nf4_base.h)

  bool enabled() const { return rank > 0; }
  // Throws naming the lora.* key when a value is out of range or a module name unknown.
  void validate(const KeyDescriber& keys = {}) const;
};

namespace lora_bounds {
inline constexpr ValueRange rank = {0, 65536};
inline constexpr ValueRange alpha = above(0);
inline constexpr ValueRange dropout = {0.0, 1.0, false, true};
}  // namespace lora_bounds

// The decoder's projections, by their PEFT / torchtune / Hugging Face module names:
// attention's (Multi-head Latent Attention's q_a_proj, q_b_proj, kv_a_proj_with_mqa and
// kv_b_proj too) and the feed-forward's (DeepSeek's shared experts' too), and a
// Mixture-of-Experts block's router and routed experts' stacks. What all-linear adapts
// (those the model has); on a MoE model as PEFT 0.21 on transformers 5 does, without the
// dense blocks' and shared experts' feed-forward (lora_modules_for_model, NOTE [LoRA on
// MoE and MLA models] in model/lora.h).
inline const std::vector<std::string> kLoraModules = {"q_proj",    "k_proj",   "v_proj",   "o_proj",
                                                      "gate_proj", "up_proj",  "down_proj", "q_a_proj",
                                                      "q_b_proj",  "kv_a_proj_with_mqa", "kv_b_proj",
                                                      "gate", "experts.gate_up_proj", "experts.down_proj"};
// The routed experts' stacked weights, by transformers 5's parameter names under the MoE
// block (model.layers.N.mlp.experts.gate_up_proj [E, 2F, H], .down_proj [E, H, F]): what
// PEFT adapts through target_parameters (its ParamWrapper, NOTE [LoRA on routed experts] in
// ops/lora_experts.h), which matches these suffixes too.
inline const std::vector<std::string> kLoraExpertModules = {"experts.gate_up_proj", "experts.down_proj"};
// A Mixture-of-Experts block's router (Mixtral's block_sparse_moe.gate, DeepSeek's
// mlp.gate), which PEFT adapts as a parameter (target_parameters "gate.weight").
inline const std::string kLoraRouterModule = "gate";

// NOTE [Fused LoRA targets]
// qkv_proj and gate_up_proj name forge's fused projections whole (NOTE [Fused projections]
// in model/parameters.h): one adapter, A of rank r over the input and B over all the fused
// rows, instead of one per member module. That is LoRA on a model whose attention has a
// fused qkv_proj, as MLPerf's Llama 2 70B LoRA reference trains it (its
// llama-v2-fused-qkv checkpoint, --lora_target_modules "qkv_proj,o_proj"), and NeMo's
// linear_qkv adapter: fewer parameters than separate q, k and v adapters (r × (in + q + 2
// kv) against r × (3 in + q + 2 kv)) and not the same function family. PEFT names its
// tensors base_model.model.model.layers.N.self_attn.qkv_proj.lora_A.weight. A fused name
// cannot be combined with its members.
inline const std::vector<std::pair<std::string, std::vector<std::string>>> kLoraFusedModules = {
    {"qkv_proj", {"q_proj", "k_proj", "v_proj"}}, {"gate_up_proj", {"gate_proj", "up_proj"}}};
// Every name lora.target_modules accepts, in the order lora_target_modules returns them.
inline const std::vector<std::string> kLoraModuleNames = {"qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_up_proj", "gate_proj", "up_proj", "down_proj",
                                                          "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                          "gate", "experts.gate_up_proj", "experts.down_proj"};

// The modules lora.target_modules names, in kLoraModuleNames order ("all-linear": the
// separate modules, kLoraModules; PEFT's all-linear leaves the output head out, as forge
// does). Throws naming the key on an unknown or repeated name, an empty list, all-linear
// beside other names, or a fused name beside one of its members.
std::vector<std::string> lora_target_modules(const std::string& target_modules, const KeyDescriber& keys = {});

}  // namespace forge
