// Reads one YAML config file into a flat list of settings (dotted key, value text,
// "file:line"), checking its shape on the way: the file and every section or group are
// maps, every key is known to the schema (else a did-you-mean), no key appears twice, and
// every value is a scalar. Values are kept as text; the schema parses them when applied.
#pragma once

#include <string>
#include <vector>

namespace forge {

struct ConfigSetting {
  std::string key;    // dotted, e.g. model.rope_scaling.factor
  std::string value;  // scalar text as written
  std::string where;  // "exp.yaml:4" or "command line"
};

// prefix "" reads an experiment file (top level: sections); prefix "model" reads a model
// file (top level: model keys).
std::vector<ConfigSetting> read_config_file(const std::string& path, const std::string& prefix);

}  // namespace forge
