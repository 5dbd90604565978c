// The "pattern" of Split, Replace normalizers and Replace decoders in tokenizer.json:
// {"String": "literal"} or {"Regex": "pcre-compatible pattern"}.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer_json_reader.h"
#include "data/tokenizer_regex.h"
#include "data/tokenizer_split.h"

namespace forge {

struct TokenizerPattern {
  std::string literal;                  // used when regex is null
  std::unique_ptr<TokenizerRegex> regex;

  TokenizerPattern(const nlohmann::json& component, const TokenizerJsonReader& reader, const std::string& where);
  std::vector<ByteRange> find_all(std::string_view text) const;
  // Every match replaced by `content`.
  std::string replace_all(std::string_view text, std::string_view content) const;
};

}  // namespace forge
