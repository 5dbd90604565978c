// How one forge parameter splits into Hugging Face tensors: forge's fused qkv is q_proj,
// k_proj and v_proj stacked along dim 0, gate_up is gate_proj and up_proj (NOTE [Fused
// projections] in model/parameters.h); every other parameter is one Hugging Face tensor.
// Import and export both walk these parts, so the two can never disagree on the layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/parameters.h"

namespace forge {

struct HfPart {
  std::string name;  // Hugging Face tensor name
  Shape shape;       // its shape
  int64_t offset;    // first element inside the forge parameter
};

std::vector<HfPart> hf_parts(const ParamSpec& spec, const ModelConfig& config);

}  // namespace forge
