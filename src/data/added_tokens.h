// Added tokens of a tokenizer.json (special tokens such as <|begin_of_text|>, and others
// added after training) are found in the text before pre-tokenization and become one id
// each, as in Hugging Face's AddedVocabulary:
//   - matching is leftmost-longest over all contents, non-overlapping;
//   - single_word: a match touching a word character on either side is skipped (the regex
//     crate's Unicode \w, as tokenizers' AddedVocabulary checks it: unicode_classes.h);
//   - lstrip / rstrip: whitespace left / right of the match is absorbed into it;
//   - normalized: the token is matched in normalized text (its content normalized too),
//     otherwise in the original text, before the normalizer runs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  std::string matched_content;  // content, normalized for normalized tokens: matched and decoded as this
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// A piece of text: either an added token's id or a range of text to tokenize normally.
struct TextSegment {
  size_t begin, end;
  int32_t token_id;  // -1: plain text
};

class AddedTokenMatcher {
 public:
  explicit AddedTokenMatcher(std::vector<AddedToken> tokens);

  bool empty() const { return tokens_.empty(); }
  // Added tokens and the plain text between them, in order, covering `text`.
  std::vector<TextSegment> split(std::string_view text) const;

 private:
  std::vector<AddedToken> tokens_;
  std::vector<std::vector<size_t>> by_first_byte_;  // token indices, longest content first
};

}  // namespace forge
