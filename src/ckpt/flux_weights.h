// FLUX transformer weights in and out of the two published layouts.
//
// NOTE [FLUX weight files]
// diffusers  a model folder (FLUX.1-dev's transformer/ subfolder, or the repository folder
//            holding it) with diffusion_pytorch_model.safetensors or its sharded index and
//            config.json: FluxTransformer2DModel's names, q, k and v separate (forge's
//            fused to_qkv / to_added_qkv stack them, NOTE [Fused projections]).
// bfl        Black Forest Labs' single file (flux1-dev.safetensors): double_blocks.{i}.
//            img_attn.qkv (q, k, v fused), img_mod.lin, img_mlp.0/.2, ...; single_blocks.{i}.
//            linear1 (q, k, v and the MLP's input stacked: forge's attn.to_qkv and proj_mlp),
//            linear2, modulation.lin; time_in / vector_in / guidance_in, img_in, txt_in, and
//            final_layer.adaLN_modulation.1, whose (shift, scale) halves are diffusers'
//            (scale, shift) swapped (diffusers' convert_flux_transformer_checkpoint_to_diffusers).
// Loading checks every tensor: each parameter must be there with the shape the model
// expects, and a tensor the model has no place for is an error naming it, so a file of
// another architecture (or of a proxy's block count) is refused rather than half-loaded.
// A diffusers folder's config.json must agree with the model too.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/flux_weights_export.h"
#include "ckpt/safetensors.h"
#include "model/flux_parameters.h"

namespace forge {

enum class FluxWeightLayout { Diffusers, Bfl };

// A directory is a diffusers folder (its transformer/ subfolder when it has one), a file
// BFL's single file.
FluxWeightLayout flux_weight_layout_of(const std::string& path);

// Reads every parameter into `params` (fp32 on the CPU).
void load_flux_weights(const std::string& path, FluxParameters& params);

// The same reads and checks, a parameter at a time: `take` is handed each of `specs` (the
// model's flux_parameter_specs, in order) as its fp32 values, in a host buffer of the
// largest one that the next call reuses. FSDP ranks keep their segments of each, so no rank
// holds the whole model (NOTE [FLUX FSDP checkpoints] in train/flux_checkpoint.h).
void read_flux_weights(const std::string& path, const FluxConfig& config, const std::vector<ParamSpec>& specs,
                       const std::function<void(size_t, std::span<const float>)>& take);

// Writes `params` (fp32 on the CPU) stored as `stored` (F32, BF16 or F16): a diffusers folder
// (diffusion_pytorch_model.safetensors, sharded past 10 GB with its index, and config.json:
// the files FSDP ranks write in pieces, NOTE [FLUX export in pieces] in
// ckpt/flux_weights_export.h) or a BFL single file, atomically.
// `max_shard_bytes`: where a diffusers folder's file is cut (diffusers' own 10 GB by default).
void save_flux_weights(const std::string& path, const FluxParameters& params, FluxWeightLayout layout,
                       SafetensorsDType stored, uint64_t max_shard_bytes = kDiffusersMaxShardBytes);

}  // namespace forge
