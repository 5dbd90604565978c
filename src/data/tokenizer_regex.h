// A compiled regular expression for tokenizer patterns (pre-tokenizer splits, Replace
// normalizers and decoders), run by PCRE2 with Unicode properties (PCRE2_UTF | PCRE2_UCP)
// and JIT-compiled where the platform allows.
//
// NOTE [Invalid UTF-8 in tokenizer regexes]
// Patterns are compiled with PCRE2_MATCH_INVALID_UTF: an invalid byte in the text never
// matches anything and no match spans it. With the Llama 3 and GPT-2 split patterns an
// invalid byte therefore ends up in a piece between matches, which byte-level BPE still
// tokenizes byte by byte.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace forge {

class TokenizerRegex {
 public:
  // Throws forge::Error "<file>: <where>: invalid regex ..." when the pattern does not compile.
  TokenizerRegex(const std::string& pattern, const std::string& file, const std::string& where);
  ~TokenizerRegex();
  TokenizerRegex(const TokenizerRegex&) = delete;
  TokenizerRegex& operator=(const TokenizerRegex&) = delete;

  // Byte ranges [begin, end) of the successive non-overlapping matches, leftmost first.
  // After an empty match the search resumes one character later.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace forge
