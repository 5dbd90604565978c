// CLIP text encoder weights from the files transformers and the FLUX.1 repositories publish.
//
// NOTE [CLIP text weight files]
// `path` is one of
//   - a transformers CLIPTextModel folder (FLUX.1-dev's text_encoder/): config.json and
//     model.safetensors, or model.safetensors.index.json and its shards;
//   - a folder holding such a folder as text_encoder/ (the FLUX.1-dev repository);
//   - one .safetensors file: with the config.json beside it if there is one, else as the
//     CLIP-L preset (clip_l_text_config).
// Tensor names are CLIPTextModel's (NOTE [CLIP text parameters]) as transformers 5 writes
// them, or with "text_model." in front as transformers 4 wrote them (FLUX.1's and Stable
// Diffusion's files): all of a model's names one way or all the other. A position_ids buffer
// that older transformers saved ("embeddings.position_ids", [1, max_position_embeddings],
// int64 0, 1, 2, ...) is checked and skipped. Every parameter must be there, with its shape
// and a dtype of F32, BF16 or F16 (read as fp32); a missing one, a wrong shape or dtype, or
// a tensor the encoder has no place for (a CLIPModel's vision tower, the projection of
// CLIPTextModelWithProjection, another model's file) stops the load naming the file and the
// tensor.
#pragma once

#include <string>

#include "model/clip_text_config.h"
#include "model/clip_text_encoder.h"

namespace forge {

// The config of the encoder at `path`: its folder's config.json, or for a lone file the one
// beside it or else CLIP-L.
ClipTextConfig read_clip_text_encoder_config(const std::string& path);

// Reads every parameter of the encoder at `path` into `params` (fp32 on the CPU), which must
// have its config's shapes.
void load_clip_text_weights(const std::string& path, ClipTextParameters& params);

}  // namespace forge
