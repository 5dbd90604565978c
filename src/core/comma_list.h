// Comma-separated lists in config values and on the command line (lora.target_modules,
// precision.fp8_filter_fqns, a bench sweep's values): split at every comma, the blanks
// (spaces, tabs) around each item trimmed. Empty items are kept, so that the caller can
// refuse them naming its key.
#pragma once

#include <string>
#include <vector>

namespace forge {

inline std::string trim_blanks(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

// "a, b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
inline std::vector<std::string> split_comma_list(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  for (size_t comma; (comma = text.find(',', start)) != std::string::npos; start = comma + 1)
    items.push_back(trim_blanks(text.substr(start, comma - start)));
  items.push_back(trim_blanks(text.substr(start)));
  return items;
}

}  // namespace forge
