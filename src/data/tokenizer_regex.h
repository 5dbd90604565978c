// A compiled regular expression for tokenizer patterns (pre-tokenizer splits, Replace
// normalizers and decoders): written in tokenizers' Oniguruma syntax, translated to PCRE2
// with tokenizers' own Unicode classes (NOTE [Oniguruma patterns in PCRE2] in
// oniguruma_pattern.h), run by PCRE2 and JIT-compiled where the platform allows.
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
  // Throws forge::Error "<file>: <where>: ... regex '<pattern>' ..." when the pattern is
  // invalid or uses a construct forge does not translate.
  TokenizerRegex(const std::string& pattern, const std::string& file, const std::string& where);
  ~TokenizerRegex();
  TokenizerRegex(const TokenizerRegex&) = delete;
  TokenizerRegex& operator=(const TokenizerRegex&) = delete;

  // Byte ranges [begin, end) of the successive non-overlapping matches, leftmost first, as
  // tokenizers iterates them (the onig crate's find_iter): an empty match right where the
  // previous match ended is skipped, and after an empty match the search resumes one
  // character later.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace forge
