// FLUX VAE weights from the two published layouts.
//
// NOTE [FLUX VAE weight files]
// diffusers  a VAE folder (FLUX.1-dev's vae/ subfolder, or the repository folder holding it)
//            with diffusion_pytorch_model.safetensors (or its sharded index) and config.json:
//            AutoencoderKL's names (NOTE [FLUX VAE parameters] in model/flux_vae_parameters.h),
//            convolutions [O, I, K, K], the attention projections [C, C].
// bfl        Black Forest Labs' single file (ae.safetensors): the original latent-diffusion
//            names that diffusers' convert_ldm_vae_checkpoint maps (loaders/single_file_utils.py):
//            {encoder,decoder}.conv_in / conv_out / norm_out (diffusers' conv_norm_out);
//            encoder.down.{i}.block.{j}.{norm1,conv1,norm2,conv2,nin_shortcut} (conv_shortcut)
//            and encoder.down.{i}.downsample.conv; decoder.up.{n-1-i}.block.{j} and
//            decoder.up.{n-1-i}.upsample.conv for diffusers' up block i (BFL numbers the up
//            blocks from the output end); {encoder,decoder}.mid.block_1 / block_2 (the mid
//            block's resnets 0 and 1) and mid.attn_1.{norm, q, k, v, proj_out}, whose q, k,
//            v and proj_out weights are 1x1 convolutions [C, C, 1, 1]. The file has no config:
//            its architecture is FLUX's (the flux1-vae preset).
// Loading converts each tensor to forge's layout (convolutions to [O, K, K, I], to_q, to_k,
// to_v stacked into to_qkv) and checks every one: each parameter must be there with the
// shape the model expects, and a tensor the model has no place for is an error naming it,
// so a file of another model is refused rather than half-loaded. A diffusers folder's
// config.json must describe the model the weights are loaded into.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/flux_vae_parameters.h"

namespace forge {

enum class FluxVaeWeightLayout { Diffusers, Bfl };

// A directory is a diffusers folder (its vae/ subfolder when it has no weights of its own but
// has one), a file BFL's single file; anything else fails naming the path.
FluxVaeWeightLayout flux_vae_weight_layout_of(const std::string& path);

// The VAE's architecture at `path`: a diffusers folder's config.json (which it must have),
// the flux1-vae preset for BFL's file.
FluxVaeConfig flux_vae_config_at(const std::string& path);

// Reads every parameter into `params` (fp32 on the CPU).
void load_flux_vae_weights(const std::string& path, FluxVaeParameters& params);

// The weights at `path` (of `config`, flux_vae_config_at(path)) on `device`: fp32 on the CPU,
// bf16 on CUDA (read through an fp32 host copy), as forge prep --images and forge sample run
// the VAE.
std::unique_ptr<FluxVaeParameters> load_flux_vae(const std::string& path, const FluxVaeConfig& config, Device device);

// Every tensor a file of `layout` holds for the VAE `config`, with its shape there, in the
// order of the parameters they make up.
std::vector<std::pair<std::string, Shape>> flux_vae_file_tensors(const FluxVaeConfig& config,
                                                                 FluxVaeWeightLayout layout);

// A diffusers parameter name in BFL's layout (NOTE [FLUX VAE weight files]); `levels` is the
// number of down (and up) blocks.
std::string flux_vae_bfl_name(const std::string& diffusers_name, int64_t levels);

}  // namespace forge
