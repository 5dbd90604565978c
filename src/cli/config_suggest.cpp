// Edit distance and nearest-name suggestions; see config_suggest.h.
#include "cli/config_suggest.h"

#include <algorithm>
#include <fmt/format.h>

#include "cli/config_schema.h"

namespace forge {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  // d[i][j]: distance between the first i characters of a and the first j of b.
  const std::size_t rows = a.size() + 1, cols = b.size() + 1;
  std::vector<std::size_t> d(rows * cols);
  auto at = [&](std::size_t i, std::size_t j) -> std::size_t& { return d[i * cols + j]; };
  for (std::size_t i = 0; i < rows; ++i) at(i, 0) = i;
  for (std::size_t j = 0; j < cols; ++j) at(0, j) = j;
  for (std::size_t i = 1; i < rows; ++i) {
    for (std::size_t j = 1; j < cols; ++j) {
      const std::size_t substitution = a[i - 1] == b[j - 1] ? 0 : 1;
      at(i, j) = std::min({at(i - 1, j) + 1, at(i, j - 1) + 1, at(i - 1, j - 1) + substitution});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        at(i, j) = std::min(at(i, j), at(i - 2, j - 2) + 1);
      }
    }
  }
  return at(rows - 1, cols - 1);
}

std::optional<std::string> closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  const std::size_t threshold = std::max<std::size_t>(2, word.size() / 4);
  std::optional<std::string> best;
  std::size_t best_distance = threshold + 1;
  for (const auto& candidate : candidates) {
    // The distance is at least the difference in length, so a candidate that differs by
    // that much cannot win and is not compared: a mistyped key of megabytes (found by
    // fuzz_experiment_yaml) would otherwise fill a table of gigabytes per candidate.
    const std::size_t length_difference =
        word.size() > candidate.size() ? word.size() - candidate.size() : candidate.size() - word.size();
    if (length_difference >= best_distance) continue;
    const std::size_t distance = edit_distance(word, candidate);
    if (distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

namespace {

std::string_view last_component(std::string_view dotted) {
  const auto dot = dotted.rfind('.');
  return dot == std::string_view::npos ? dotted : dotted.substr(dot + 1);
}

}  // namespace

std::optional<std::string> suggest_config_key(std::string_view unknown_key) {
  std::vector<std::string> names, last_components;
  for (const auto& key : config_schema()) {
    for (auto dot = key.name.find('.'); dot != std::string::npos; dot = key.name.find('.', dot + 1)) {
      const std::string group = key.name.substr(0, dot);
      if (std::find(names.begin(), names.end(), group) == names.end()) names.push_back(group);
    }
    names.push_back(key.name);
    last_components.emplace_back(last_component(key.name));
  }
  if (auto full = closest_match(unknown_key, names)) return full;
  auto component = closest_match(last_component(unknown_key), last_components);
  if (!component) return std::nullopt;
  for (const auto& key : config_schema()) {
    if (last_component(key.name) == *component) return key.name;
  }
  return std::nullopt;
}

std::string did_you_mean(const std::optional<std::string>& suggestion) {
  return suggestion ? fmt::format(" — did you mean '{}'?", *suggestion) : std::string();
}

}  // namespace forge
