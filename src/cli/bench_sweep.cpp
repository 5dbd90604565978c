// Expanding `forge bench` overrides into runs; see bench_sweep.h.
//
// NOTE [Sweep lists]
// A comma in an override's value separates the values of a sweep only where a comma can
// never be part of one value. The schema decides: integers, numbers, true/false and enum
// keys (training.device, precision.compute_dtype, ...) may list values, and so may
// model.name, a string that names one of configs/models/ and so never holds a comma. Other
// strings are free text (data.path, data.blend, logging.run_dir, ...): a comma there is
// refused, since it is either a mistaken sweep or a path forge would silently split.
// data.split is the one free-text key whose value is itself comma-separated ("969,30,1",
// Megatron's --split); it is taken whole and cannot be swept. Every listed value is
// checked against its key here, so a typo fails before the first run rather than after
// hours of others.
#include "cli/bench_sweep.h"

#include <algorithm>
#include <cctype>
#include <string_view>

#include <fmt/format.h>

#include "cli/config_schema.h"
#include "cli/config_suggest.h"
#include "core/comma_list.h"
#include "core/error.h"

namespace forge {
namespace {

constexpr const char* kCommandLine = "command line";

bool may_list(const ConfigKey& key) { return key.type != ConfigValueType::String || key.name == "model.name"; }

const ConfigKey& known_key(const std::string& name) {
  const ConfigKey* key = find_config_key(name);
  if (key) return *key;
  if (is_config_group(name)) {
    FORGE_FAIL("{}: '{}' is a group of keys; set one of them, such as --{}.<key>", kCommandLine, name, name);
  }
  FORGE_FAIL("{}: unknown key '{}'{}", kCommandLine, name, did_you_mean(suggest_config_key(name)));
}

// The values of one override: a checked list, or the text as it was given.
std::vector<std::string> values_of(const ConfigKey& key, const std::string& text) {
  // Keys whose one value is itself a comma-separated list are never swept.
  const bool comma_valued = is_comma_list_key(key.name);
  if (text.find(',') == std::string::npos || comma_valued) return {text};
  if (!may_list(key)) {
    FORGE_FAIL("{}: --{} takes one value, got the list '{}': bench sweeps list values only for numbers, "
               "true/false, keys with fixed choices and model.name",
               kCommandLine, key.name, text);
  }
  std::vector<std::string> values = split_comma_list(text);
  ExperimentConfig scratch;
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i].empty()) FORGE_FAIL("{}: --{} lists an empty value in '{}'", kCommandLine, key.name, text);
    if (std::find(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(i), values[i]) !=
        values.begin() + static_cast<std::ptrdiff_t>(i)) {
      FORGE_FAIL("{}: --{} lists '{}' twice in '{}'", kCommandLine, key.name, values[i], text);
    }
    if (key.type != ConfigValueType::String) set_config_value(key, scratch, values[i], kCommandLine);
  }
  return values;
}

// A value as one shell word: as is when it is made of ordinary characters, else in single
// quotes (a quote inside written '\'').
std::string shell_word(const std::string& value) {
  const bool plain = !value.empty() && std::all_of(value.begin(), value.end(), [](unsigned char c) {
    return std::isalnum(c) || std::string_view("_-.,/:=+@%").find(static_cast<char>(c)) != std::string_view::npos;
  });
  if (plain) return value;
  std::string quoted = "'";
  for (char c : value) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

}  // namespace

std::vector<SweepPoint> expand_sweep(const ConfigOverrides& overrides) {
  std::vector<std::vector<std::string>> lists;
  for (size_t i = 0; i < overrides.size(); ++i) {
    const auto& [name, text] = overrides[i];
    for (size_t j = 0; j < i; ++j) {
      if (overrides[j].first == name) {
        FORGE_FAIL("{}: --{} is given twice; give its values once, comma-separated ('{},{}')", kCommandLine, name,
                   overrides[j].second, text);
      }
    }
    lists.push_back(values_of(known_key(name), text));
  }

  std::vector<SweepPoint> points;
  std::vector<size_t> index(lists.size(), 0);
  while (true) {
    SweepPoint point;
    for (size_t k = 0; k < lists.size(); ++k) {
      const std::string& value = lists[k][index[k]];
      point.overrides.emplace_back(overrides[k].first, value);
      point.args += fmt::format("{}--{} {}", k ? " " : "", overrides[k].first, shell_word(value));
    }
    points.push_back(std::move(point));
    // Odometer step: the last key turns fastest.
    size_t k = lists.size();
    while (k > 0 && ++index[k - 1] == lists[k - 1].size()) index[--k] = 0;
    if (k == 0) break;
  }
  return points;
}

}  // namespace forge
