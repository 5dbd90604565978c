// load_experiment and parse_overrides; see config.h for the precedence rules.
//
// Every value, whatever its source, becomes a ConfigSetting (key, text, origin) and goes
// through the schema's set_config_value, so a YAML file and the command line accept and
// reject exactly the same things. The origin of each key's final value is remembered for
// the messages of validate_experiment's rules.
#include <algorithm>
#include <filesystem>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/config.h"
#include "cli/config_defaults.h"
#include "cli/config_hf_model.h"
#include "cli/config_model_files.h"
#include "cli/config_reader.h"
#include "cli/config_schema.h"
#include "cli/config_suggest.h"
#include "cli/config_validate.h"
#include "core/error.h"

namespace forge {
namespace {

constexpr const char* kCommandLine = "command line";

ConfigSetting override_setting(const std::pair<std::string, std::string>& override_pair) {
  const auto& [name, value] = override_pair;
  if (!find_config_key(name)) {
    if (is_config_group(name)) {
      FORGE_FAIL("{}: '{}' is a group of keys; set one of them, such as --{}.<key>", kCommandLine, name, name);
    }
    FORGE_FAIL("{}: unknown key '{}'{}", kCommandLine, name, did_you_mean(suggest_config_key(name)));
  }
  return {name, value, kCommandLine};
}

// "--steps=10" -> "steps": what a malformed override was probably naming.
std::string bare_name(const std::string& arg) {
  const auto start = arg.find_first_not_of('-');
  if (start == std::string::npos) return "";
  return arg.substr(start, arg.find('=', start) - start);
}

// The last setting of `key`, or nullptr.
const ConfigSetting* last_setting(const std::vector<ConfigSetting>& settings, const std::string& key) {
  const ConfigSetting* found = nullptr;
  for (const auto& setting : settings) {
    if (setting.key == key) found = &setting;
  }
  return found;
}

std::vector<std::string> path_strings(const std::vector<std::filesystem::path>& paths) {
  std::vector<std::string> strings;
  for (const auto& path : paths) strings.push_back(path.string());
  return strings;
}

class ExperimentBuilder {
 public:
  void apply(const ConfigSetting& setting) {
    set_config_value(*find_config_key(setting.key), config_, setting.value, setting.where);
    origins_[setting.key] = setting.where;
  }

  void load_model(const std::string& name, const std::string& name_origin, const std::string& experiment_path) {
    const auto dirs = model_search_dirs(experiment_path);
    if (auto file = find_model_file(name, dirs)) {
      for (const auto& setting : read_config_file(file->string(), "model")) {
        if (setting.key == "model.name") {
          FORGE_FAIL("{}: model.name cannot be set in a model file; the file's name is the model's name",
                     setting.where);
        }
        apply(setting);
      }
    } else if (name == kDefaultModelName) {
      config_.model = debug_tiny_model();
    } else {
      const auto available = available_models(dirs);
      FORGE_FAIL("{}: model '{}' not found{}: looked in {}; available: {}", name_origin, name,
                 did_you_mean(closest_match(name, available)), fmt::join(path_strings(dirs), ", "),
                 available.empty() ? "none (set FORGE_CONFIG_DIR to a directory with models/*.yaml)"
                                   : fmt::format("{}", fmt::join(available, ", ")));
    }
    config_.model.name = name;
    origins_["model.name"] = name_origin;
  }

  // NOTE [A Hugging Face directory is the model file] in config_hf_model.h.
  void load_hf_model(HfStart start, const ConfigSetting* name_setting) {
    config_.model = start.model;
    for (const auto& key : config_schema())
      if (key.name.starts_with("model.")) origins_[key.name] = hf_config_origin(start);
    if (name_setting) {
      config_.model.name = name_setting->value;
      origins_["model.name"] = name_setting->where;
    }
    config_.checkpoint.initial_load_in_hf = true;
    origins_["checkpoint.initial_load_in_hf"] = "implied by checkpoint.initial_load_path";
    hf_start_ = std::move(start);
  }

  ExperimentConfig finish() {
    // A model key whose origin is not config.json was set by a file or the command line:
    // those are what the conflict check compares.
    if (hf_start_) {
      check_hf_model_conflicts(config_, *hf_start_, origins_);
      // The default seq_len is a pre-training default, not a request: a smaller model's own length replaces it.
      if (!origins_.contains("training.seq_len")) {
        config_.training.seq_len = std::min(config_.training.seq_len, config_.model.max_seq_len);
      }
    }
    if (config_.checkpoint.export_dtype == "auto") config_.checkpoint.export_dtype = default_export_dtype(hf_start_);
    validate_experiment(config_, origins_);
    return config_;
  }

 private:
  ExperimentConfig config_;
  ConfigOrigins origins_;
  std::optional<HfStart> hf_start_;
};

}  // namespace

ConfigOverrides parse_overrides(const std::vector<std::string>& args) {
  ConfigOverrides overrides;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    const std::string body = arg.starts_with("--") ? arg.substr(2) : std::string();
    const auto equals = body.find('=');
    const std::string name = body.substr(0, equals);
    const auto dot = name.find('.');
    if (dot == std::string::npos || dot == 0 || name.back() == '.') {
      FORGE_FAIL("{}: expected an override --section.key value or --section.key=value, got '{}'{}", kCommandLine, arg,
                 did_you_mean(suggest_config_key(bare_name(arg))));
    }
    if (equals != std::string::npos) {
      overrides.emplace_back(name, body.substr(equals + 1));
      continue;
    }
    if (i + 1 == args.size() || args[i + 1].starts_with("--")) {
      FORGE_FAIL("{}: --{} has no value (write --{} <value> or --{}=<value>)", kCommandLine, name, name, name);
    }
    overrides.emplace_back(name, args[++i]);
  }
  return overrides;
}

ExperimentConfig load_experiment(const std::string& experiment_path, const ConfigOverrides& overrides) {
  std::vector<ConfigSetting> experiment_settings;
  if (!experiment_path.empty()) {
    std::error_code error;
    if (!std::filesystem::exists(experiment_path, error)) {
      FORGE_FAIL("experiment file '{}' not found", experiment_path);
    }
    experiment_settings = read_config_file(experiment_path, "");  // says what a non-regular file is
  }
  std::vector<ConfigSetting> override_settings;
  for (const auto& override_pair : overrides) override_settings.push_back(override_setting(override_pair));

  // The final setting of a key: the command line's, else the experiment file's.
  auto final_setting = [&](const std::string& key) {
    const ConfigSetting* setting = last_setting(override_settings, key);
    return setting ? setting : last_setting(experiment_settings, key);
  };
  const ConfigSetting* name_setting = final_setting("model.name");

  ExperimentBuilder builder;
  if (auto hf = find_hf_start(final_setting("checkpoint.initial_load_path"),
                              final_setting("checkpoint.initial_load_in_hf"))) {
    builder.load_hf_model(std::move(*hf), name_setting);
  } else {
    builder.load_model(name_setting ? name_setting->value : kDefaultModelName,
                       name_setting ? name_setting->where : "default value", experiment_path);
  }
  for (const auto* settings : {&experiment_settings, &override_settings}) {
    for (const auto& setting : *settings) {
      if (setting.key != "model.name") builder.apply(setting);
    }
  }
  return builder.finish();
}

}  // namespace forge
