// The T5 encoder's published weights (FLUX.1's text_encoder_2) into forge's
// T5Weights.
//
// NOTE [T5 weight files]
// A transformers T5EncoderModel folder: config.json (read_t5_config) and
// model.safetensors, or the shards model.safetensors.index.json names
// (FLUX.1-dev's text_encoder_2/ holds two, bf16), in fp32, bf16 or fp16. A
// pipeline folder (FLUX.1-dev itself) stands for its text_encoder_2/ subfolder.
// Every tensor is checked against the config: each one the encoder needs must
// be there with its shape, and a tensor it has no place for (a decoder's, a
// per-layer position bias, another architecture's) stops the load naming the
// file and the tensor, rather than being skipped. The embedding is tied:
// transformers writes it as shared.weight and, some versions, again as
// encoder.embed_tokens.weight; either will do, and when both are there
// shared.weight is the one read (as transformers ties encoder.embed_tokens to
// it), the other checked for shape only.
#pragma once

#include <string>

#include "core/tensor.h"
#include "model/t5_encoder.h"

namespace forge {

// `path` itself, or its text_encoder_2/ subfolder when it holds no config.json
// of its own and has one (a diffusers pipeline folder).
std::string t5_encoder_folder(const std::string& path);

// Reads every tensor of the folder's weights into `weights` (any device and
// dtype: each tensor goes through an fp32 host copy of its own).
void load_t5_weights(const std::string& folder, const T5Weights& weights);

// The config (t5_encoder_folder(path)/config.json) and weights of an encoder,
// on `device` in `dtype` (fp32 on the CPU, bf16 on CUDA).
T5Weights load_t5_encoder(const std::string& path, Device device = Device::CPU, DType dtype = DType::F32);

}  // namespace forge
