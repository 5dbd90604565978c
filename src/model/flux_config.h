// FluxConfig: every architecture knob of the FLUX.1 rectified-flow image transformer
// (Black Forest Labs' `flux` repository, diffusers' FluxTransformer2DModel), a model family
// of its own (NOTE [Model families] in decoder_lm.h).
//
// NOTE [FLUX architecture]
// A FLUX transformer denoises a latent image given a text: its inputs are the noisy
// latent's 2x2 patches as tokens (ops/patchify.h: 16 VAE channels x 4 = 64 features), the
// T5 text encoder's token features (4096), CLIP's pooled text vector (768), the time t and,
// for guidance-distilled models (FLUX.1-dev), the guidance scale. Two residual streams,
// text and image, run through `num_double_blocks` double-stream blocks (each stream its own
// weights, one joint attention over both), are concatenated [text, image], and run through
// `num_single_blocks` single-stream blocks (attention and a GELU MLP side by side, their
// outputs concatenated into one projection). Every block is modulated (adaLN-Zero) by a
// conditioning vector: the sum of MLP embeddings of the sinusoidal time, the guidance and
// the pooled text. Queries and keys are RMS-normalized per head and rotated by RoPE over
// three position axes (0 for text; image row, image column) whose frequencies split the
// head dim as axes_dim (16/56/56 of 128). The image stream leaves through a modulated layer
// norm and a projection back to the patch features: the predicted velocity.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

struct FluxConfig {
  std::string name;
  int64_t in_channels = 64;    // features of a latent token (patchified channels)
  int64_t out_channels = 0;    // 0: in_channels
  int64_t num_heads = 24;
  int64_t head_dim = 128;
  int64_t num_double_blocks = 19;
  int64_t num_single_blocks = 38;
  int64_t mlp_ratio = 4;       // MLP hidden = hidden * mlp_ratio
  int64_t context_dim = 4096;  // text encoder (T5) features: diffusers' joint_attention_dim
  int64_t pooled_dim = 768;    // pooled text (CLIP) features: pooled_projection_dim
  bool guidance_embeds = true; // FLUX.1-dev: true; FLUX.1-schnell: false
  std::vector<int64_t> axes_dim = {16, 56, 56};
  double rope_theta = 10000.0;
  int64_t timestep_dim = 256;  // sinusoidal features of the time and the guidance
  float norm_eps = 1e-6f;

  int64_t hidden() const { return num_heads * head_dim; }
  int64_t mlp_hidden() const { return hidden() * mlp_ratio; }
  int64_t resolved_out_channels() const { return out_channels > 0 ? out_channels : in_channels; }

  // Throws naming the bad knob (and `source`, the file or preset it came from).
  void validate(std::string_view source = "flux config") const;

  // Parameter counts (nothing when they overflow int64).
  std::optional<int64_t> checked_double_block_params() const;
  std::optional<int64_t> checked_single_block_params() const;
  std::optional<int64_t> checked_total_params() const;
  int64_t total_params() const;

  // Model FLOPs of one image's forward + backward (NOTE [FLUX FLOPs] in flux_config.cpp),
  // at image_tokens latent tokens and text_tokens text tokens.
  double training_flops_per_image(int64_t image_tokens, int64_t text_tokens) const;
};

// The published architectures and a tiny one: "flux1-dev", "flux1-schnell", "flux-small", "flux-debug".
// Throws listing the names for any other.
FluxConfig flux_preset(std::string_view name);
std::vector<std::string> flux_preset_names();
bool is_flux_preset(std::string_view name);

}  // namespace forge
