// How one forge parameter splits into Hugging Face tensors, as its ParamSpec lists them
// (the block component that declares a parameter says what it is made of): forge's fused
// qkv is q_proj, k_proj and v_proj stacked along dim 0, gate_up is gate_proj and up_proj
// (NOTE [Fused projections] in model/parameters.h); every other parameter is one Hugging
// Face tensor. A stack of matrices [E, R, C] (a MoE block's experts) splits along its
// E x R rows, each part a [rows, C] matrix: Mixtral's per-expert w1 / w3 slices of gate_up,
// w2 of down. A part whose rows hold rotary features in DeepSeek's interleaved pairs
// (HfTensor::rotary_rows) carries the order of its rows: the tensor's row r is the
// parameter's row row_order[r] within the part. Import and export both walk these parts,
// so the two can never disagree on the layout.
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
  // Row r of the tensor is row row_order[r] of the part (counted from `offset`); empty: the
  // same row.
  std::vector<int64_t> row_order = {};
  bool keep_fp32 = false;  // HfTensor::keep_fp32
};

// HfRotaryRows as an order of a tensor's `rows` rows: in every block of `period` rows, the
// tensor's row first + 2j is forge's row first + j and its row first + 2j + 1 forge's
// first + count/2 + j (HfPart::row_order).
std::vector<int64_t> rotary_row_order(const HfRotaryRows& rotary, int64_t rows);

// `interleaved_rotary` false: rotary rows are stored in forge's own order (DeepSeek-V3's
// rope_interleave false), so no part reorders them.
std::vector<HfPart> hf_parts(const ParamSpec& spec, bool interleaved_rotary = true);

// The parameter's row (of its stacked matrix) at each row of its Hugging Face tensors taken
// in order, where hf_parts reorders some (NOTE [NF4 stored row order] in ops/nf4.h); empty
// when every row is the tensors' own.
std::vector<int64_t> hf_stored_rows(const ParamSpec& spec, bool interleaved_rotary);

// Tensors that transformers holds, and its save_pretrained writes, with no elements:
// DeepseekV2Moe / DeepseekV3MoE build their shared experts even when n_shared_experts is 0,
// as [0, hidden] gate_proj and up_proj and a [hidden, 0] down_proj in every MoE block.
// Import accepts them (with these shapes), export writes them.
std::vector<HfPart> hf_empty_parts(const ModelConfig& config);

}  // namespace forge
