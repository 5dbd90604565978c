#include "data/tokenizer_split.h"

#include <algorithm>

#include "data/utf8.h"

namespace forge {

std::optional<SplitBehavior> split_behavior_from_name(std::string_view name) {
  if (name == "Removed") return SplitBehavior::Removed;
  if (name == "Isolated") return SplitBehavior::Isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (name == "Contiguous") return SplitBehavior::Contiguous;
  return std::nullopt;
}

std::vector<ByteRange> find_literal(std::string_view text, std::string_view literal) {
  std::vector<ByteRange> matches;
  if (literal.empty()) return matches;
  for (size_t pos = text.find(literal); pos != std::string_view::npos; pos = text.find(literal, pos + literal.size()))
    matches.emplace_back(pos, pos + literal.size());
  return matches;
}

std::vector<ByteRange> find_characters(std::string_view text, bool (*predicate)(int32_t)) {
  std::vector<ByteRange> matches;
  for (size_t pos = 0; pos < text.size();) {
    const size_t length = utf8::unit_length(text, pos);
    if (predicate(utf8::code_point_at(text, pos))) matches.emplace_back(pos, pos + length);
    pos += length;
  }
  return matches;
}

std::vector<ByteRange> split_ranges(std::string_view text, const std::vector<ByteRange>& matches,
                                    SplitBehavior behavior, bool invert) {
  struct Part {
    ByteRange range;
    bool is_match;
  };
  std::vector<Part> parts;
  size_t previous = 0;
  for (const auto& [begin, end] : matches) {
    if (begin != previous) parts.push_back({{previous, begin}, invert});
    parts.push_back({{begin, end}, !invert});
    previous = end;
  }
  if (previous != text.size()) parts.push_back({{previous, text.size()}, invert});

  std::vector<ByteRange> pieces;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::Removed:
      for (const auto& p : parts)
        if (!p.is_match) pieces.push_back(p.range);
      break;
    case SplitBehavior::Isolated:
      for (const auto& p : parts) pieces.push_back(p.range);
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const auto& p : parts) {
        if (p.is_match && !previous_match && !pieces.empty()) {
          pieces.back().second = p.range.second;
        } else {
          pieces.push_back(p.range);
        }
        previous_match = p.is_match;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !previous_match && !pieces.empty()) {
          pieces.back().first = it->range.first;
        } else {
          pieces.push_back(it->range);
        }
        previous_match = it->is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    case SplitBehavior::Contiguous:
      for (const auto& p : parts) {
        if (p.is_match == previous_match && !pieces.empty()) {
          pieces.back().second = p.range.second;
        } else {
          pieces.push_back(p.range);
        }
        previous_match = p.is_match;
      }
      break;
  }
  std::erase_if(pieces, [](const ByteRange& r) { return r.first == r.second; });
  return pieces;
}

}  // namespace forge
