#include "data/tokenizer_pattern.h"

namespace forge {

TokenizerPattern::TokenizerPattern(const nlohmann::json& component, const TokenizerJsonReader& reader,
                                   const std::string& where) {
  const auto& pattern = reader.object(component, where, "pattern");
  if (pattern.contains("Regex")) {
    regex = std::make_unique<TokenizerRegex>(reader.string(pattern, where + ".pattern", "Regex"), reader.file(),
                                             where + ".pattern");
  } else if (pattern.contains("String")) {
    literal = reader.string(pattern, where + ".pattern", "String");
    if (literal.empty()) reader.fail(where + ".pattern", "the String pattern must not be empty");
  } else {
    reader.fail(where + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}");
  }
}

std::vector<ByteRange> TokenizerPattern::find_all(std::string_view text) const {
  return regex ? regex->find_all(text) : find_literal(text, literal);
}

std::string TokenizerPattern::replace_all(std::string_view text, std::string_view content) const {
  std::string out;
  out.reserve(text.size());
  size_t previous = 0;
  for (const auto& [begin, end] : find_all(text)) {
    out.append(text.substr(previous, begin - previous));
    out.append(content);
    previous = end;
  }
  out.append(text.substr(previous));
  return out;
}

}  // namespace forge
