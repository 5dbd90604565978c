#include "data/added_tokens.h"

#include <algorithm>

#include "data/unicode_classes.h"
#include "data/utf8.h"

namespace forge {

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens)
    : tokens_(std::move(tokens)), by_first_byte_(256) {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i].matched_content.empty()) continue;
    by_first_byte_[static_cast<uint8_t>(tokens_[i].matched_content[0])].push_back(i);
  }
  for (auto& candidates : by_first_byte_) {
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](size_t a, size_t b) { return tokens_[a].matched_content.size() > tokens_[b].matched_content.size(); });
  }
}

std::vector<TextSegment> AddedTokenMatcher::split(std::string_view text) const {
  struct Match {
    size_t begin, end, token;
  };
  std::vector<Match> matches;
  for (size_t pos = 0; pos < text.size();) {
    bool found = false;
    for (size_t index : by_first_byte_[static_cast<uint8_t>(text[pos])]) {
      const std::string& content = tokens_[index].matched_content;
      if (text.compare(pos, content.size(), content) == 0) {
        matches.push_back({pos, pos + content.size(), index});
        pos += content.size();
        found = true;
        break;
      }
    }
    if (!found) ++pos;
  }

  std::vector<TextSegment> segments;
  size_t covered = 0;
  for (auto [begin, end, index] : matches) {
    const AddedToken& token = tokens_[index];
    if (token.single_word) {
      const bool word_before =
          begin > 0 && unicode::is_added_token_word_character(utf8::code_point_before(text, begin));
      const bool word_after =
          end < text.size() && unicode::is_added_token_word_character(utf8::code_point_at(text, end));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      while (begin > covered && utf8::is_whitespace(utf8::code_point_before(text, begin)))
        begin -= utf8::unit_length_before(text, begin);
    }
    if (token.rstrip) {
      while (end < text.size() && utf8::is_whitespace(utf8::code_point_at(text, end)))
        end += utf8::unit_length(text, end);
    }
    if (covered < begin) segments.push_back({covered, begin, -1});
    segments.push_back({begin, end, token.id});
    covered = end;
  }
  if (covered < text.size()) segments.push_back({covered, text.size(), -1});
  return segments;
}

}  // namespace forge
