#include "model/lora_config.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/comma_list.h"
#include "core/error.h"

namespace forge {

std::vector<std::string> lora_target_modules(const std::string& target_modules, const KeyDescriber& keys) {
  const std::vector<std::string> names = split_comma_list(target_modules);
  const std::string key = "lora.target_modules";
  const std::string expected =
      fmt::format("a comma-separated list of {} or all-linear", fmt::join(kLoraModuleNames, ", "));
  if (names.size() == 1 && names[0] == "all-linear") return kLoraModules;
  std::vector<std::string> chosen;
  for (const std::string& name : names) {
    if (name.empty())
      FORGE_FAIL("{} has an empty module name: expected {}", keys.describe(key, "'" + target_modules + "'"), expected);
    if (name == "all-linear")
      FORGE_FAIL("{}: all-linear already names every module and stands alone", keys.describe(key, target_modules));
    if (std::find(kLoraModuleNames.begin(), kLoraModuleNames.end(), name) == kLoraModuleNames.end())
      FORGE_FAIL("{}: '{}' is not a module of the decoder; expected {}", keys.describe(key, target_modules), name,
                 expected);
    if (std::find(chosen.begin(), chosen.end(), name) != chosen.end())
      FORGE_FAIL("{}: '{}' is named twice", keys.describe(key, target_modules), name);
    chosen.push_back(name);
  }
  for (const auto& [fused, members] : kLoraFusedModules)  // NOTE [Fused LoRA targets]
    for (const std::string& member : members)
      if (std::count(chosen.begin(), chosen.end(), fused) && std::count(chosen.begin(), chosen.end(), member))
        FORGE_FAIL("{}: '{}' adapts {} whole and cannot be combined with '{}'", keys.describe(key, target_modules),
                   fused, fmt::join(members, ", "), member);
  std::vector<std::string> ordered;
  for (const std::string& m : kLoraModuleNames)
    if (std::find(chosen.begin(), chosen.end(), m) != chosen.end()) ordered.push_back(m);
  return ordered;
}

void LoraConfig::validate(const KeyDescriber& keys) const {
  check_range(keys, "lora.rank", rank, lora_bounds::rank);
  check_range(keys, "lora.alpha", alpha, lora_bounds::alpha);
  check_range(keys, "lora.dropout", dropout, lora_bounds::dropout);
  lora_target_modules(target_modules, keys);
  if (!enabled() && !adapter_path.empty())
    FORGE_FAIL("{} is set but {}: set lora.rank (and lora.alpha, lora.target_modules) to the adapter's values",
               keys.describe("lora.adapter_path", adapter_path), keys.describe("lora.rank", rank));
}

}  // namespace forge
