// Starting a run from a Hugging Face model directory with one setting,
// checkpoint.initial_load_path: DIR.
//
// NOTE [A Hugging Face directory is the model file]
// When the final checkpoint.initial_load_path is a directory holding config.json (and no
// forge checkpoint), or checkpoint.initial_load_in_hf is true, DIR/config.json takes the
// place of configs/models/<model.name>.yaml: it gives every model.* key (hf_config.h maps
// it), model.name defaults to the model's name (hf_model_name: the directory's, or the
// repository's for a hub-cache snapshot) and only names the run, no model file is read,
// and checkpoint.initial_load_in_hf becomes true. The experiment file and the command
// line may still set model keys, but only to the values config.json gives (a resolved
// config.yaml, which lists them all, runs again as it is): any other value is refused
// naming the key, both values and the file, since the weights could not be loaded into
// it. model.init_std is not architecture and stays free; the rope_scaling values are
// compared only where RoPE scaling is on. Training on longer sequences than
// max_position_embeddings is training.allow_longer_seq_len, not a model.max_seq_len
// change; an unset training.seq_len (the default 128) is cut to a smaller model's
// max_position_embeddings.
#pragma once

#include <optional>
#include <string>

#include "cli/config_reader.h"
#include "cli/config_validate.h"
#include "model/config.h"
#include "train/experiment.h"

namespace forge {

struct HfStart {
  std::string dir;
  std::string origin;  // where checkpoint.initial_load_path was set
  ModelConfig model;   // from DIR/config.json, named after the model
};

// The Hugging Face model the run starts from, from the final settings of
// checkpoint.initial_load_path and checkpoint.initial_load_in_hf (either may be null), or
// none. A path that exists but is neither a forge checkpoint nor a Hugging Face model,
// and initial_load_in_hf false for a Hugging Face directory, are errors. A path that
// does not exist is left to the trainer (a resumed run never reads it).
std::optional<HfStart> find_hf_start(const ConfigSetting* path, const ConfigSetting* in_hf);

// "DIR/config.json": the origin of the model keys a Hugging Face directory sets.
std::string hf_config_origin(const HfStart& start);

// Fails on the first model.* key that `origins` says was set elsewhere than
// hf_config_origin and whose value differs from the directory's (NOTE [A Hugging Face
// directory is the model file]).
void check_hf_model_conflicts(const ExperimentConfig& config, const HfStart& start, const ConfigOrigins& origins);

// checkpoint.export_dtype auto: the dtype config.json declares (dtype / torch_dtype),
// else that of the stored weights; bf16 for a run not started from Hugging Face.
std::string default_export_dtype(const std::optional<HfStart>& start);

}  // namespace forge
