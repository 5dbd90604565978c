// `forge info flux1-dev` (and the other FLUX presets): the architecture, parameters, FLOPs
// per image and the memory of training it on one device.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace forge {

// Prints the report; overrides: training.local_batch_size, flux.resolution (pixels, a
// multiple of 16), flux.text_tokens, activation_checkpoint.mode (none | full).
int run_flux_info(const std::string& name, const std::vector<std::pair<std::string, std::string>>& overrides);

}  // namespace forge
