// LoRA adapters in Hugging Face PEFT's format, written and read:
//   adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, target_modules, ...
//   adapter_model.safetensors  base_model.model.<module>.lora_A.weight [r, in] and
//                              .lora_B.weight [out, r] per adapted module (fp32)
// so that peft.PeftModel.from_pretrained(base, dir) loads what forge trained, and forge
// continues training from what PEFT saved (NOTE [LoRA training] in model/lora.h: forge's
// fused projections hold PEFT's separate modules as parts).
#pragma once

#include <string>

#include "model/lora.h"

namespace forge {

// Writes `dir` (replaced whole if it exists: an AtomicDirectory) from the adapters'
// masters. base_model: what adapter_config.json names as the base model ("" for none).
void save_peft_adapter(const std::string& dir, const LoraAdapters& adapters, const std::string& base_model);

// Reads `dir` into the adapters' masters (and their compute copy). The adapter must match
// the run's lora settings (r, lora_alpha, target_modules; a plain LoRA: no DoRA, rsLoRA,
// rank or alpha patterns, bias or modules_to_save) and the model (every tensor present
// with its shape, none extra); every error names the file and the key or tensor.
void load_peft_adapter(const std::string& dir, LoraAdapters& adapters);

// The LoRA settings the adapter `dir` states in adapter_config.json: r, lora_alpha,
// lora_dropout and target_modules (as forge's module names, comma-separated). Errors
// name the file and the key; load_peft_adapter then checks the rest against the model.
LoraConfig read_peft_adapter_settings(const std::string& dir);

}  // namespace forge
