// The decoder of a tokenizer.json: turns the token strings of ids back into text, as a
// chain of steps over the list of token strings. Supported, as Llama-family files use
// them: ByteLevel (GPT-2 characters back to bytes), Replace, ByteFallback ("<0x0A>" tokens
// back to bytes), Fuse, Strip, Metaspace, Sequence. Other types are rejected at load time.
//
// NOTE [Decoding to bytes]
// Hugging Face returns a Python str, so where the bytes of the tokens are not valid UTF-8
// (invalid input text, or ids cut in the middle of a character) it substitutes U+FFFD.
// forge returns the bytes themselves: decode(encode(text)) == text for any bytes, and for
// valid UTF-8 the result is the same as Hugging Face's.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/tokenizer_json_reader.h"
#include "data/tokenizer_pattern.h"

namespace forge {

class Decoder {
 public:
  // `config` is tokenizer.json's "decoder" value (null: tokens joined with spaces, as HF does).
  Decoder(const nlohmann::json& config, const TokenizerJsonReader& reader);

  std::string decode(std::vector<std::string> tokens) const;

 private:
  enum class Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace };
  struct Step {
    Kind kind;
    std::unique_ptr<TokenizerPattern> pattern;  // Replace
    std::string content;                        // Replace's replacement, Strip's character, Metaspace's replacement
    int64_t strip_start = 0, strip_stop = 0;
    bool strip_first_replacement = true;        // Metaspace with a prepend scheme other than "never"
  };
  void add(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& where);
  static void apply(const Step& step, std::vector<std::string>& tokens);

  bool present_ = false;
  std::vector<Step> steps_;
};

}  // namespace forge
