// The model forge eval and forge generate run: --model (NOTE [Model sources]) with
// --adapter merged into it (NOTE [Adapters at inference]), or a LoRA run directory, which
// names both itself.
//
// NOTE [A LoRA run as a model]
// A run directory whose config.yaml has lora.rank > 0 holds no model weights: its
// checkpoints hold the adapters only (NOTE [LoRA checkpoints]). As --model it stands for
// its base, config.yaml's checkpoint.initial_load_path (a Hugging Face folder or a forge
// checkpoint, read as load_model reads any model; a relative path as the run read it, from
// the current directory), with its newest adapter, <run_dir>/adapter (rewritten at every
// checkpoint save and at the end of training), merged; the adapter must have the run's
// lora.rank, lora.alpha and lora.target_modules. --adapter beside such a run is refused:
// give the base as --model instead. A QLoRA run's adapter is merged into the unquantized
// base (as PEFT merges one), with a warning that this differs slightly from the NF4 base
// it trained on.
#pragma once

#include <string>

#include "ckpt/model_source.h"

namespace forge {

// `adapter`: a PEFT adapter directory, or "" for none.
LoadedModel load_inference_model(const std::string& model, const std::string& adapter);

}  // namespace forge
