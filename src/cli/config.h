// The config system's front door: from an experiment YAML file and --section.key
// overrides to a validated ExperimentConfig, and back to YAML.
//
// Precedence, lowest first:
//   built-in defaults (ExperimentConfig's initializers)
//   ← the model file configs/models/<model.name>.yaml (model.name defaults to debug-tiny)
//   ← the experiment file (its model: section overrides the model file's keys)
//   ← command-line overrides.
// model.name picks the model file wherever it is set; a --model.name override wins over
// the experiment file's and is applied first, then the other keys in the order above.
// A Hugging Face model directory as checkpoint.initial_load_path takes the model file's
// place (NOTE [A Hugging Face directory is the model file] in config_hf_model.h).
//
// Model files are searched in $FORGE_CONFIG_DIR/models, then configs/models next to each
// ancestor directory of the experiment file (nearest first), then the source tree's
// configs/models. Every error is a forge::Error that names the key, where its value came
// from (file:line or "command line") and what was expected.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "train/experiment.h"

namespace forge {

using ConfigOverrides = std::vector<std::pair<std::string, std::string>>;

// Accepts "--section.key value" and "--section.key=value" (keys are checked later, by
// load_experiment). Throws on a key with no value or an argument that is not --section.key.
ConfigOverrides parse_overrides(const std::vector<std::string>& args);

// experiment_path may be empty: the default run (debug-tiny on synthetic data).
ExperimentConfig load_experiment(const std::string& experiment_path, const ConfigOverrides& overrides);

// The resolved config as YAML: every key, sections in order, each with its description
// as a comment. load_experiment of this text (with the model file of model.name present)
// gives back the same config.
std::string to_yaml(const ExperimentConfig& config);

// Every key with what it accepts, its default and description, for --help.
std::string describe_keys();

}  // namespace forge
