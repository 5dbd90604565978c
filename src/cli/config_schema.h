// The config schema: one table row per dotted key ("training.local_batch_size") that says
// which field of ExperimentConfig it sets, the value's type, the allowed range or values,
// and a one-line description. Everything that touches keys reads this one table: the
// YAML and command-line loaders (to apply values and reject unknown keys), --help and
// did-you-mean (to list keys), and to_yaml (to print every key in order).
//
// A row's type is deduced from the C++ type of its field (int64_t and uint64_t are
// integers, double is a float, bool, std::string), so the table cannot disagree with the
// struct. A string row with allowed values is an enum.
//
// The model's and the optimizer's keys take their ranges and choices from the layer that
// owns them (model/config_rules.h, optim/config_rules.h), which checks the same bounds
// where no config file exists; the rows here only point at them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/config_check.h"
#include "train/experiment.h"

namespace forge {

enum class ConfigValueType { Integer, Float, Bool, String, Enum };

using ConfigField = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*>;

struct ConfigKey {
  std::string name;  // dotted: section.key or section.group.key
  ConfigValueType type;
  std::string description;
  ValueRange range;                  // numbers only
  std::vector<std::string> choices;  // enums only
  ConfigField (*field)(ExperimentConfig&);
};

// Every key, grouped by section in the order of ExperimentConfig (model, training,
// optimizer, lr_scheduler, data, eval, logging, precision, parallelism).
const std::vector<ConfigKey>& config_schema();

// The section names, in order.
const std::vector<std::string>& config_sections();

// nullptr when `name` is not a key.
const ConfigKey* find_config_key(std::string_view name);

// Whether a key's one value is a comma-separated list (data.split, lora.target_modules,
// precision.fp8_filter_fqns): a YAML file may give it as a list of scalars, joined with
// commas, and a bench sweep never splits it into runs.
bool is_comma_list_key(std::string_view name);

// True when some key starts with `prefix` + "." (a section or a group such as
// model.rope_scaling).
bool is_config_group(std::string_view prefix);

// What a key accepts, for messages and --help: "an integer >= 1", "one of cpu, cuda".
std::string describe_expected(const ConfigKey& key);

// Parses `text` and stores it in the key's field. On a bad value throws forge::Error
// "<where>: <key> expects <expected>, got '<text>'".
void set_config_value(const ConfigKey& key, ExperimentConfig& config, const std::string& text,
                      const std::string& where);

// Throws the same error as set_config_value when the key's current value is out of range
// or not an allowed choice (for values that did not come through set_config_value: defaults,
// configs built in code).
void check_config_value(const ConfigKey& key, const ExperimentConfig& config, const std::string& where);

// The key's current value as YAML scalar text (round-trips through set_config_value).
std::string format_config_value(const ConfigKey& key, const ExperimentConfig& config);

}  // namespace forge
