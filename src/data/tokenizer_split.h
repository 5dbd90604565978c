// Splitting text at pattern matches, as Hugging Face's Split pre-tokenizer does it. The
// matches of a pattern cut the text into alternating match / non-match ranges; the
// behavior says what becomes of the matches: Removed drops them, Isolated keeps them as
// pieces of their own, MergedWithPrevious / MergedWithNext glue each to the neighbouring
// non-match piece, Contiguous joins runs of matches. `invert` swaps the roles first.
// Empty pieces are dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace forge {

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// "Isolated" → SplitBehavior::Isolated; nullopt for an unknown name.
std::optional<SplitBehavior> split_behavior_from_name(std::string_view name);

using ByteRange = std::pair<size_t, size_t>;

// Non-overlapping occurrences of `literal` in `text`, leftmost first.
std::vector<ByteRange> find_literal(std::string_view text, std::string_view literal);

// Each character of `text` for which `predicate(code point)` holds, as a match of its own
// (tokenizers' pattern of a char predicate); invalid bytes are passed as -1.
std::vector<ByteRange> find_characters(std::string_view text, bool (*predicate)(int32_t));

// The pieces of `text` (as byte ranges) given the pattern's `matches`.
std::vector<ByteRange> split_ranges(std::string_view text, const std::vector<ByteRange>& matches,
                                    SplitBehavior behavior, bool invert);

}  // namespace forge
