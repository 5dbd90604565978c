// The position and time features of a FLUX transformer, computed on the host once per
// micro-batch (they are a few kilobytes): the sinusoidal time (and guidance) features and
// the rotary tables of the joint [text, image] sequence.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/flux_config.h"

namespace forge {

// diffusers' get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0):
// for each value v (the time or guidance already times 1000, as FluxTransformer2DModel
// scales them) [cos(v f_k) for k < dim/2, then sin(v f_k)], f_k = 10000^(-k / (dim/2)).
// Returns [values.size(), dim] fp32 on the CPU.
Tensor timestep_features(const std::vector<float>& values, int64_t dim);

// NOTE [FLUX rotary positions]
// Every token of the joint sequence has three position ids: text tokens (0, 0, 0), image
// token (i, j) of the latent grid (0, i, j) (diffusers' _prepare_latent_image_ids). The head
// dim's rotary pairs are split among the axes as axes_dim (pairs [0, 8) the first axis,
// [8, 36) the second, [36, 64) the third for 16/56/56), and pair k of an axis of dim d turns
// by position * theta^(-2k/d) (diffusers' FluxPosEmbed: get_1d_rotary_pos_embed per axis,
// concatenated). Returns cos and sin [text_tokens + grid_h * grid_w, head_dim / 2], fp32 on
// the CPU, text first.
void flux_rope_tables(Tensor& cos, Tensor& sin, const FluxConfig& config, int64_t text_tokens, int64_t grid_h,
                      int64_t grid_w);

}  // namespace forge
