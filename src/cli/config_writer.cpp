// to_yaml and describe_keys: the schema table printed as YAML and as help text.
//
// to_yaml walks the keys in table order and opens a YAML map whenever the dotted path
// enters a new section or group (model.rope_scaling.*), so the output nests exactly as
// the files users write. Each key's description follows as a comment, aligned, so the
// saved config.yaml of a run documents itself.
#include <algorithm>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/config.h"
#include "cli/config_defaults.h"
#include "cli/config_schema.h"

namespace forge {
namespace {

std::vector<std::string> split_dotted(std::string_view name) {
  std::vector<std::string> parts;
  while (true) {
    const auto dot = name.find('.');
    parts.emplace_back(name.substr(0, dot));
    if (dot == std::string_view::npos) return parts;
    name.remove_prefix(dot + 1);
  }
}

std::string key_comment(const ConfigKey& key) {
  if (key.type != ConfigValueType::Enum) return key.description;
  return fmt::format("{} ({})", key.description, fmt::join(key.choices, " | "));
}

}  // namespace

std::string to_yaml(const ExperimentConfig& config) {
  struct Line {
    std::string text;
    std::string comment;
  };
  std::vector<Line> lines;
  std::vector<std::string> open_groups;
  for (const auto& key : config_schema()) {
    std::vector<std::string> groups = split_dotted(key.name);
    const std::string leaf = groups.back();
    groups.pop_back();
    std::size_t shared = 0;
    while (shared < open_groups.size() && shared < groups.size() && open_groups[shared] == groups[shared]) ++shared;
    if (shared == 0 && !open_groups.empty()) lines.push_back({"", ""});
    for (std::size_t depth = shared; depth < groups.size(); ++depth) {
      lines.push_back({std::string(2 * depth, ' ') + groups[depth] + ":", ""});
    }
    open_groups = groups;
    const std::string indent(2 * groups.size(), ' ');
    lines.push_back({fmt::format("{}{}: {}", indent, leaf, format_config_value(key, config)), key_comment(key)});
  }

  constexpr std::size_t kMaxCommentColumn = 48;
  std::size_t comment_column = 0;
  for (const auto& line : lines) {
    if (!line.comment.empty()) comment_column = std::max(comment_column, std::min(line.text.size(), kMaxCommentColumn));
  }
  std::string yaml =
      "# forge experiment config, resolved: every key, from the defaults, the model file, the\n"
      "# experiment file and the command line, with the batch sizes derived. Loading this file\n"
      "# again gives the same config.\n";
  for (const auto& line : lines) {
    if (line.comment.empty()) {
      yaml += line.text + "\n";
    } else {
      yaml += fmt::format("{:<{}}  # {}\n", line.text, comment_column, line.comment);
    }
  }
  return yaml;
}

std::string describe_keys() {
  ExperimentConfig defaults;
  defaults.model = debug_tiny_model();
  std::string help = "Config keys; set any in the experiment file or as --<key> <value> or --<key>=<value>:\n";
  std::string section;
  for (const auto& key : config_schema()) {
    const std::string key_section = split_dotted(key.name).front();
    if (key_section != section) {
      section = key_section;
      help += "\n" + section + ":\n";
    }
    help += fmt::format("  --{} <{}>  (default {})\n      {}\n", key.name, describe_expected(key),
                        format_config_value(key, defaults), key.description);
  }
  return help;
}

}  // namespace forge
