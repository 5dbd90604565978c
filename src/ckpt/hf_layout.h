// How one forge parameter splits into Hugging Face tensors, as its ParamSpec lists them
// (the block component that declares a parameter says what it is made of): forge's fused
// qkv is q_proj, k_proj and v_proj stacked along dim 0, gate_up is gate_proj and up_proj
// (NOTE [Fused projections] in model/parameters.h); every other parameter is one Hugging
// Face tensor. A stack of matrices [E, R, C] (a MoE block's experts) splits along its
// E x R rows, each part a [rows, C] matrix: Mixtral's per-expert w1 / w3 slices of gate_up,
// w2 of down. Import and export both walk these parts, so the two can never disagree on
// the layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/parameters.h"

namespace forge {

struct HfPart {
  std::string name;  // Hugging Face tensor name
  Shape shape;       // its shape
  int64_t offset;    // first element inside the forge parameter
};

std::vector<HfPart> hf_parts(const ParamSpec& spec);

}  // namespace forge
