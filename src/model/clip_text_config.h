// ClipTextConfig: the knobs of CLIP's text encoder (transformers' CLIPTextModel), the model
// FLUX.1 takes its pooled text vector from (NOTE [CLIP text encoder] in
// clip_text_encoder.h), read from the config.json of a transformers text_encoder folder.
//
// NOTE [CLIP pooling rule]
// CLIPTextModel's pooler_output is one row of the last hidden state per caption, the
// end-of-text token's. Which row depends on config.json's eos_token_id, as transformers
// decides it (modeling_clip.py, after its PR #24773):
//   eos_token_id == 2   the legacy rule, kept for configs written before the fix (FLUX.1's
//                       and Stable Diffusion's text_encoder/config.json say 2): the
//                       position of the largest token id of the row, the first one among
//                       equals (<|endoftext|>, 49407, is the largest id of CLIP's
//                       vocabulary, and padding with it repeats it: the first is taken).
//   anything else       the first position whose id is eos_token_id; a row without one
//                       pools position 0 (transformers' argmax of an all-zero row).
// For captions CLIP's tokenizer made (data/clip_tokenizer.h) both pick the same row.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace forge {

// The MLP's activation, by transformers' ACT2FN name: quick_gelu (x sigmoid(1.702 x),
// OpenAI CLIP's), gelu (exact, erf), gelu_new and gelu_pytorch_tanh (the tanh
// approximation).
enum class ClipActivation { QuickGelu, GeluErf, GeluTanh };

struct ClipTextConfig {
  std::string name;
  int64_t vocab_size = 49408;
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_layers = 12;
  int64_t num_heads = 12;
  int64_t max_positions = 77;  // max_position_embeddings: tokens per caption at most
  double layer_norm_eps = 1e-5;
  ClipActivation activation = ClipActivation::QuickGelu;
  int64_t eos_token_id = 2;  // NOTE [CLIP pooling rule]

  int64_t head_dim() const { return hidden_size / num_heads; }
  bool legacy_pooling() const { return eos_token_id == 2; }
  std::optional<int64_t> checked_total_params() const;  // nothing when it overflows int64
  int64_t total_params() const;

  // Throws naming the bad knob and `source` (the file or preset it came from).
  void validate(std::string_view source) const;
};

// openai/clip-vit-large-patch14's text tower as FLUX.1-dev and -schnell ship it
// (text_encoder/config.json): 12 layers of 768 (12 heads of 64), MLP 3072, quick GELU, 77
// positions, eos_token_id 2 (the legacy pooling rule). 123,060,480 parameters.
ClipTextConfig clip_l_text_config();

// The config.json of a transformers CLIPTextModel folder, read as transformers' CLIPTextConfig
// reads it (absent keys take its defaults: vocab 49408, hidden 512, MLP 2048, 12 layers, 8
// heads, 77 positions, quick_gelu, eps 1e-5, eos_token_id 49407). Every key forge uses is
// checked; another architecture ("architectures" other than CLIPTextModel, "model_type"
// other than clip_text_model) is refused naming the file and the key.
ClipTextConfig clip_text_config_from_json(const nlohmann::json& config, const std::string& path);
ClipTextConfig read_clip_text_config(const std::string& path);

std::string_view clip_activation_name(ClipActivation activation);

}  // namespace forge
