// The normalizer of a tokenizer.json: rewrites each piece of text between added tokens
// before pre-tokenization. forge implements what Llama-family files use: Prepend (adds a
// string in front of non-empty text, e.g. Llama 2's "▁"), Replace (a literal string or a
// regex, every occurrence) and Sequence of those. Anything else (NFC, Lowercase, ...) is
// rejected when the file is loaded, naming the file and the type.
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
  struct Step {
    std::string prepend;                         // a Prepend step when non-empty
    std::unique_ptr<TokenizerPattern> pattern;   // a Replace step otherwise
    std::string content;                         // Replace's replacement
  };
  void add(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& where, int depth);
  std::string file_;  // tokenizer.json, for errors while normalizing
  std::vector<Step> steps_;
};

}  // namespace forge
