// The weights `forge eval` and `forge generate` run, named by one path.
//
// NOTE [Model sources]
// A path names a model in one of the forms training leaves behind or starts from:
//   a Hugging Face folder (config.json): the architecture from config.json (hf_config.h),
//     the weights from its safetensors converted to fp32 (hf_import.h);
//   a forge checkpoint step-<N> (metadata.json): the architecture from its metadata, its
//     parameters (not the optimizer state), every piece CRC-checked as it is read;
//   a folder of checkpoints, or a run directory holding one as checkpoints/ (the default
//     checkpoint.folder): its newest checkpoint that reads whole; a damaged one is reported
//     and the one before it is tried, as a resume chooses (NOTE [Choosing the checkpoint
//     to resume]).
// The result is the model's config and fp32 weights in host memory; the caller moves them
// to its device. A LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors,
// or a forge adapter) will be a second path loaded beside the base weights into this same
// LoadedModel and handed to the linear op's weight descriptors (NOTE [Linear weight
// descriptor]): nothing here assumes the base weights are all a model has.
#pragma once

#include <memory>
#include <string>

#include "model/config.h"
#include "model/parameters.h"

namespace forge {

struct LoadedModel {
  ModelConfig config;
  std::unique_ptr<FlatParameters> params;  // fp32, host memory
  std::string description;                 // what was loaded, for logs and reports
  std::string hf_dir;                      // the Hugging Face folder, when the model is one
};

// Loads the model `path` names (NOTE [Model sources]); errors name the path and the forms
// it could have had.
LoadedModel load_model(const std::string& path);

}  // namespace forge
