// YAML file → flat settings; see config_reader.h. yaml-cpp keeps duplicate map keys (a
// later lookup silently sees the first), so duplicates are caught here while walking.
#include "cli/config_reader.h"

#include <map>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/eventhandler.h>
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
    } else if (value.IsSequence() && is_comma_list_key(key.name)) {  // [layers.0., layers.31.]
      std::vector<std::string> items;
      for (size_t i = 0; i < value.size(); ++i) {
        const YAML::Node item = value[i];
        if (!item.IsScalar() || item.Scalar().find(',') != std::string::npos)
          FORGE_FAIL("{}: {} item {} must be one name without commas, got {}", where, key.name, i,
                     describe_node(item));
        items.push_back(item.Scalar());
      }
      out_.push_back({key.name, fmt::format("{}", fmt::join(items, ",")), where});
    } else {
      FORGE_FAIL("{}: {} expects {}, got {}", where, key.name, describe_expected(key), describe_node(value));
    }
  }

  std::string path_;
  std::vector<ConfigSetting>& out_;
  std::map<std::string, int> first_lines_;
};

// NOTE [Counting YAML documents]
// A config file holds one YAML document; a second ("---") would be ignored, so it is
// refused. yaml-cpp 0.7's LoadAll loops forever on some malformed text (a 34-byte file
// found by fuzz_experiment_yaml made it build empty documents until 10 GB of memory were
// gone), so the documents are counted through the parser's events instead, with a bound:
// a document costs at least two events, and no text of n bytes yields more than a few
// events per byte, so passing 4n + 64 events means the parser is not terminating.
class DocumentCounter final : public YAML::EventHandler {
 public:
  explicit DocumentCounter(size_t text_bytes) : limit_(4 * text_bytes + 64) {}
  size_t documents() const { return documents_; }
  void OnDocumentStart(const YAML::Mark&) override {
    ++documents_;
    tick();
  }
  void OnDocumentEnd() override { tick(); }
  void OnNull(const YAML::Mark&, YAML::anchor_t) override { tick(); }
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override { tick(); }
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override { tick(); }
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    tick();
  }
  void OnSequenceEnd() override { tick(); }
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    tick();
  }
  void OnMapEnd() override { tick(); }

 private:
  void tick() {
    if (++events_ > limit_) throw std::length_error("the YAML parser does not terminate on this text");
  }
  size_t limit_, events_ = 0, documents_ = 0;
};

size_t count_documents(const std::string& path, const std::string& text) {
  std::istringstream stream(text);
  YAML::Parser parser(stream);
  DocumentCounter counter(text.size());
  try {
    while (parser.HandleNextDocument(counter)) {
    }
  } catch (const YAML::Exception& e) {
    FORGE_FAIL("{}:{}: invalid YAML: {}", path, e.mark.line + 1, e.msg);
  } catch (const std::length_error&) {
    FORGE_FAIL("{}: invalid YAML: the parser found {} or more documents in {} bytes and does not stop", path,
               counter.documents(), text.size());
  }
  return counter.documents();
}

}  // namespace

std::vector<ConfigSetting> read_config_file(const std::string& path, const std::string& prefix) {
  const std::string text = read_regular_file(path, "the config file");  // NOTE [User files must be regular files]
  // A second document ("---") would be ignored silently: one file is one config
  // (NOTE [Counting YAML documents]).
  const size_t documents = count_documents(path, text);
  if (documents > 1)
    FORGE_FAIL("{}: holds {} YAML documents (separated by '---'); a config file holds one", path, documents);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    FORGE_FAIL("{}:{}: invalid YAML: {}", path, e.mark.line + 1, e.msg);
  }
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
