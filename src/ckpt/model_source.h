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
// to its device.
//
// NOTE [Adapters at inference]
// A LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors: one PEFT saved,
// or the <run_dir>/adapter forge writes) is merged into the loaded weights,
// W += lora_alpha / r * B A (LoraAdapters::merge_into, what PEFT's merge_and_unload()
// computes), rather than attached to the linear op's descriptors: inference then runs the
// plain model, so the full forward of forge eval and the KV-cache decoder of forge
// generate (NOTE [Incremental decoding]) need nothing of their own, on the CPU in fp32 and
// on the GPU in bf16 after the merge (as a merged export would run). Adapter dropout is
// off at inference, so nothing is lost. The adapter is read through the training path's
// load_peft_adapter: every tensor present with the model's shapes and none extra, plain
// LoRA only; errors name the file and the key or tensor.
#pragma once

#include <memory>
#include <string>

#include "model/config.h"
#include "model/lora_config.h"
#include "model/parameters.h"

namespace forge {

struct LoadedModel {
  ModelConfig config;
  std::unique_ptr<FlatParameters> params;  // fp32, host memory
  std::string description;                 // what was loaded, for logs and reports
  std::string hf_dir;                      // the Hugging Face folder, when the model is one
  std::string adapter_dir;                 // the LoRA adapter merged into params, if any
};

// Loads the model `path` names (NOTE [Model sources]); errors name the path and the forms
// it could have had.
LoadedModel load_model(const std::string& path);

// Merges the PEFT adapter `dir` into model's weights (NOTE [Adapters at inference]).
// expected: the settings the adapter must have (a LoRA run's lora section: r, alpha,
// target modules), or nullptr to take the adapter's own.
void merge_adapter(LoadedModel& model, const std::string& dir, const LoraConfig* expected = nullptr);

}  // namespace forge
