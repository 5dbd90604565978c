// The built-in default model: the tiny Llama that `forge train` with no experiment file
// trains on synthetic data in seconds on a CPU. configs/models/debug-tiny.yaml holds the
// same architecture (a test checks the two agree); the loader prefers the file and falls
// back to this when no configs directory can be found, so an installed binary still runs.
#pragma once

#include <string>

#include "model/config.h"

namespace forge {

inline constexpr const char* kDefaultModelName = "debug-tiny";

ModelConfig debug_tiny_model();

}  // namespace forge
