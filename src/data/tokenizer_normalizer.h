// The normalizer of a tokenizer.json: rewrites each piece of text between added tokens
// before pre-tokenization. forge implements what Llama-family files use: Prepend (adds a
// string in front of non-empty text, e.g. Llama 2's "▁"), Replace (a literal string or a
// regex, every occurrence) and Sequence of those; and what CLIP's tokenizer adds: NFC and
// Lowercase (NOTE [NFC and Lowercase as tokenizers runs them] in unicode_normalization.h).
// Anything else (NFKC, Strip, ...) is rejected when the file is loaded, naming the file and
// the type.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/tokenizer_json_reader.h"
#include "data/tokenizer_pattern.h"

namespace forge {

class Normalizer {
 public:
  // `config` is tokenizer.json's "normalizer" value (null: leave text unchanged).
  Normalizer(const nlohmann::json& config, const TokenizerJsonReader& reader);

  bool empty() const { return steps_.empty(); }
  void normalize(std::string& text) const;

 private:
  enum class Kind { Prepend, Replace, Nfc, Lowercase };
  struct Step {
    Kind kind = Kind::Replace;
    std::string prepend;                         // Prepend's text (never empty)
    std::unique_ptr<TokenizerPattern> pattern;   // Replace's pattern
    std::string content;                         // Replace's replacement
  };
  void add(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& where, int depth);
  std::string file_;  // tokenizer.json, for errors while normalizing
  std::vector<Step> steps_;
};

}  // namespace forge
