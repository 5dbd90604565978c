// YAML file → flat settings; see config_reader.h. yaml-cpp keeps duplicate map keys (a
// later lookup silently sees the first), so duplicates are caught here while walking.
#include "cli/config_reader.h"

#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include "cli/config_schema.h"
#include "cli/config_suggest.h"
#include "core/error.h"
#include "core/input_file.h"

namespace forge {
namespace {

std::string describe_node(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Scalar: return fmt::format("'{}'", node.Scalar());
    default: return "nothing";
  }
}

std::vector<std::string> keys_in_group(const std::string& group) {
  std::vector<std::string> keys;
  for (const auto& key : config_schema()) {
    if (key.name.starts_with(group + ".")) keys.push_back(key.name);
  }
  return keys;
}

class FileWalker {
 public:
  FileWalker(std::string path, std::vector<ConfigSetting>& out) : path_(std::move(path)), out_(out) {}

  void walk_map(const YAML::Node& map, const std::string& prefix) {
    for (const auto& entry : map) {
      const YAML::Node key_node = entry.first;
      const YAML::Node value = entry.second;
      const std::string where = location(key_node.Mark());
      if (!key_node.IsScalar()) FORGE_FAIL("{}: expected a key name, got {}", where, describe_node(key_node));
      const std::string name = prefix.empty() ? key_node.Scalar() : prefix + "." + key_node.Scalar();
      check_first_occurrence(name, key_node.Mark());
      if (const ConfigKey* key = find_config_key(name)) {
        add_setting(*key, value, where);
      } else if (is_config_group(name)) {
        if (value.IsMap()) {
          walk_map(value, name);
        } else if (!value.IsNull()) {
          FORGE_FAIL("{}: {} is a group of keys ({}), got {}", where, name, fmt::join(keys_in_group(name), ", "),
                     describe_node(value));
        }
      } else {
        FORGE_FAIL("{}: unknown key '{}'{}", where, name, did_you_mean(suggest_config_key(name)));
      }
    }
  }

  std::string location(const YAML::Mark& mark) const { return fmt::format("{}:{}", path_, mark.line + 1); }

 private:
  void check_first_occurrence(const std::string& name, const YAML::Mark& mark) {
    auto [first, inserted] = first_lines_.emplace(name, mark.line + 1);
    if (!inserted) FORGE_FAIL("{}: duplicate key '{}' (first set at line {})", location(mark), name, first->second);
  }

  void add_setting(const ConfigKey& key, const YAML::Node& value, const std::string& where) {
    if (value.IsScalar()) {
      out_.push_back({key.name, value.Scalar(), where});
    } else if (value.IsNull() && key.type == ConfigValueType::String) {
      out_.push_back({key.name, "", where});
    } else {
      FORGE_FAIL("{}: {} expects {}, got {}", where, key.name, describe_expected(key), describe_node(value));
    }
  }

  std::string path_;
  std::vector<ConfigSetting>& out_;
  std::map<std::string, int> first_lines_;
};

}  // namespace

std::vector<ConfigSetting> read_config_file(const std::string& path, const std::string& prefix) {
  const std::string text = read_regular_file(path, "the config file");  // NOTE [User files must be regular files]
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    FORGE_FAIL("{}:{}: invalid YAML: {}", path, e.mark.line + 1, e.msg);
  }
  // A second document ("---") would be ignored silently: one file is one config.
  if (documents.size() > 1)
    FORGE_FAIL("{}: holds {} YAML documents (separated by '---'); a config file holds one", path, documents.size());
  const YAML::Node root = documents.empty() ? YAML::Node() : documents.front();
  std::vector<ConfigSetting> settings;
  FileWalker walker(path, settings);
  if (root.IsNull()) return settings;
  if (!root.IsMap()) {
    const std::string expected =
        prefix.empty() ? fmt::format("a map of sections ({})", fmt::join(config_sections(), ", "))
                       : fmt::format("a map of {} keys", prefix);
    FORGE_FAIL("{}: expected {}, got {}", walker.location(root.Mark()), expected, describe_node(root));
  }
  walker.walk_map(root, prefix);
  return settings;
}

}  // namespace forge
