// Did-you-mean for mistyped names: config keys, enum values and model names.
//
// The distance is Damerau-Levenshtein in its "optimal string alignment" form: insertions,
// deletions, substitutions and swaps of two adjacent characters each cost 1, which is how
// people mistype ("sise" for "size", "trainnig" for "training"). A suggestion is only made
// when it is close relative to the word's length, so nonsense gets no misleading hint.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

std::size_t edit_distance(std::string_view a, std::string_view b);

// edit_distance(a, b) when it is at most `limit`, else limit + 1; costs O(|a| * limit) at
// most and stops as soon as two rows of the table exceed the limit (NOTE [Bounded edit
// distance] in config_suggest.cpp).
std::size_t edit_distance_within(std::string_view a, std::string_view b, std::size_t limit);

// The candidate nearest to `word`, if one is within max(2, |word| / 4) edits; ties go to
// the earlier candidate.
std::optional<std::string> closest_match(std::string_view word, const std::vector<std::string>& candidates);

// The config key or group a mistyped dotted name most likely meant: the nearest key or
// group ("trainig" -> "training"), else the key with the nearest last component
// ("training.lr" -> "optimizer.lr", "steps" -> "training.steps").
std::optional<std::string> suggest_config_key(std::string_view unknown_key);

// " — did you mean 'x'?" or "" when there is no suggestion.
std::string did_you_mean(const std::optional<std::string>& suggestion);

}  // namespace forge
