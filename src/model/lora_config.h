// The lora section. This branch adds only lora.quantize_base (QLoRA's NF4 base, NOTE [NF4
// base weights] in model/nf4_base.h); the LoRA keys (rank, alpha, dropout,
// target_modules) join this struct from the LoRA work.
#pragma once

#include <string>

namespace forge {

struct LoraConfig {
  std::string quantize_base = "none";  // none | nf4: the frozen base projections stored as NF4 (QLoRA)
};

}  // namespace forge
