// The FluxConfig a diffusers FluxTransformer2DModel folder's config.json describes, so that
// a folder (FLUX.1-dev's transformer/, a FLUX run's <run_dir>/diffusers export) can be used
// without naming its architecture.
//
// NOTE [FLUX transformer config.json]
// Keys and their defaults (absent keys) as FluxTransformer2DModel.__init__ has them:
// in_channels 64, out_channels null (= in_channels), num_layers 19, num_single_layers 38,
// attention_head_dim 128, num_attention_heads 24, joint_attention_dim 4096,
// pooled_projection_dim 768, guidance_embeds false, axes_dims_rope [16, 56, 56], patch_size
// 1 (the only value FLUX uses and forge builds). The MLP ratio (4), the rotary theta
// (10000) and the timestep features (256) are fixed by the class, as in forge's presets.
// Any other key (besides _class_name, _diffusers_version and _name_or_path), a _class_name
// other than FluxTransformer2DModel, or a value of the wrong type is refused naming the
// file and the key. The config's name is the preset it equals ("flux1-dev", ...), else
// "diffusers".
#pragma once

#include <string>

#include "model/flux_config.h"

namespace forge {

// `path`: a folder holding config.json, a pipeline folder holding transformer/config.json,
// or the config.json file itself.
FluxConfig read_flux_transformer_config(const std::string& path);

// The config.json file read_flux_transformer_config would read for `path`; empty when there
// is none.
std::string flux_transformer_config_file(const std::string& path);

}  // namespace forge
