// The pre-tokenizer of a tokenizer.json: cuts normalized text into the words BPE sees.
// Supported, as Llama-family files use them:
//   Split(pattern, behavior, invert)      Llama 3's digit/letter/punctuation regex
//   ByteLevel(add_prefix_space, use_regex) maps bytes to GPT-2's characters (byte_level.h),
//                                          optionally splitting with GPT-2's regex first
//   Metaspace(replacement, prepend_scheme, split)  SentencePiece's "▁" words
//   Digits(individual_digits)             splits off digits (Rust's char::is_numeric, as
//                                          tokenizers does: unicode_classes.h)
//   Sequence of the above.
// Other types are rejected at load time naming the file and the type.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/tokenizer_json_reader.h"
#include "data/tokenizer_pattern.h"

namespace forge {

struct PreToken {
  std::string text;
  bool at_text_start;  // begins at byte 0 of the original text (Metaspace's prepend_scheme "first")
};

class PreTokenizer {
 public:
  // `config` is tokenizer.json's "pre_tokenizer" value (null: the whole piece is one word).
  PreTokenizer(const nlohmann::json& config, const TokenizerJsonReader& reader);

  void pre_tokenize(std::vector<PreToken>& pieces) const;

 private:
  enum class Kind { Split, ByteLevel, Metaspace, Digits };
  enum class PrependScheme { Always, First, Never };
  struct Step {
    Kind kind;
    std::unique_ptr<TokenizerPattern> pattern;  // Split, and ByteLevel with use_regex
    SplitBehavior behavior = SplitBehavior::Isolated;
    bool invert = false;
    bool add_prefix_space = false;  // ByteLevel
    std::string replacement;        // Metaspace
    PrependScheme prepend_scheme = PrependScheme::Always;
    bool split = true;
  };
  void add(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& where, int depth);
  std::string file_;  // tokenizer.json, for errors while pre-tokenizing
  static void apply(const Step& step, std::vector<PreToken>& pieces);

  std::vector<Step> steps_;
};

}  // namespace forge
