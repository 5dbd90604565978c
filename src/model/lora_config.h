// The lora section: LoRA fine-tuning (NOTE [LoRA training] in model/lora.h), with PEFT's
// and torchtune's names for the adapted modules. rank 0 is ordinary full training.
#pragma once

#include <cstdint>
#include <string>
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

// The decoder's projections, by their PEFT / torchtune / Hugging Face module names.
inline const std::vector<std::string> kLoraModules = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"};

// The modules lora.target_modules names, in kLoraModules order ("all-linear": all of
// them; PEFT's all-linear leaves the output head out, as forge does). Throws naming the
// key on an unknown or repeated name, an empty list, or all-linear beside other names.
std::vector<std::string> lora_target_modules(const std::string& target_modules, const KeyDescriber& keys = {});

}  // namespace forge
