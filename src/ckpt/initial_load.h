// What checkpoint.initial_load_path names: a forge checkpoint (a step-<N> directory with
// metadata.json, or a folder of them) or a Hugging Face model directory (config.json
// beside model.safetensors or a sharded index). A path that is neither is refused saying
// what it holds and what was expected, so a typo or the wrong folder is caught before
// anything is built.
#pragma once

#include <string>

namespace forge {

enum class InitialLoadKind { ForgeCheckpoint, HuggingFace };

// `key` names the setting in the error ("checkpoint.initial_load_path (exp.yaml:7)").
InitialLoadKind classify_initial_load(const std::string& path, const std::string& key);

}  // namespace forge
