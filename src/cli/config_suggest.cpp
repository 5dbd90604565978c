// Edit distance and nearest-name suggestions; see config_suggest.h.
#include "cli/config_suggest.h"

#include <algorithm>
#include <array>
#include <fmt/format.h>

#include "cli/config_schema.h"

namespace forge {

// NOTE [Bounded edit distance]
// closest_match only needs to know whether a candidate beats the best so far, and every
// unknown key of a config or command line is compared with all ~600 key names, groups and
// last components (fuzz_experiment_yaml spent 58% of its time here). So the table is
// computed with its values capped at limit + 1, which changes no value up to the limit
// (min and +k commute with the cap); only cells within `limit` of the diagonal are
// computed (any other cell is at least |i - j| > limit, so it reads as limit + 1: the
// band's two neighbours in each row are set to that); and the computation stops once two
// consecutive rows are all above the limit, since every cell of a later row is reached
// from one of those two rows (or from column 0, whose value i is above the limit by then)
// at no smaller cost. Three rows are kept (a swap reaches back two rows), in a buffer
// closest_match reuses across its candidates.
namespace {

std::size_t bounded_distance(std::string_view a, std::string_view b, std::size_t limit,
                             std::vector<std::size_t>& rows) {
  const std::size_t over = limit + 1;
  if ((a.size() > b.size() ? a.size() - b.size() : b.size() - a.size()) > limit) return over;
  const std::size_t cols = b.size() + 1;
  if (rows.size() < 3 * cols) rows.resize(3 * cols);
  // Rows i - 2, i - 1 and i of the table.
  std::size_t* two_back = rows.data();
  std::size_t* previous = two_back + cols;
  std::size_t* current = previous + cols;
  for (std::size_t j = 0; j < cols; ++j) previous[j] = std::min(j, over);
  bool previous_over = false;  // every cell of row i - 1 is above the limit
  for (std::size_t i = 1; i <= a.size(); ++i) {
    current[0] = std::min(i, over);
    std::size_t row_min = current[0];
    const std::size_t first = i > limit ? i - limit : 1, last = std::min(b.size(), i + limit);
    if (first > 1) current[first - 1] = over;
    if (last < b.size()) current[last + 1] = over;
    for (std::size_t j = first; j <= last; ++j) {
      std::size_t d = std::min(previous[j], current[j - 1]) + 1;
      d = std::min(d, previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1));
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d = std::min(d, two_back[j - 2] + 1);
      current[j] = std::min(d, over);
      row_min = std::min(row_min, current[j]);
    }
    if (row_min > limit && previous_over) return over;
    previous_over = row_min > limit;
    std::size_t* const recycled = two_back;
    two_back = previous;
    previous = current;
    current = recycled;
  }
  return previous[b.size()];
}

}  // namespace

std::size_t edit_distance_within(std::string_view a, std::string_view b, std::size_t limit) {
  std::vector<std::size_t> rows;
  return bounded_distance(a, b, limit, rows);
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  return edit_distance_within(a, b, std::max(a.size(), b.size()));
}

std::optional<std::string> closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  const std::size_t threshold = std::max<std::size_t>(2, word.size() / 4);
  std::optional<std::string> best;
  std::size_t best_distance = threshold + 1;
  std::vector<std::size_t> rows;  // bounded_distance's table, reused
  // How often each byte occurs in `word`, for the bag distance below.
  std::array<std::ptrdiff_t, 256> word_counts{};
  for (char c : word) ++word_counts[static_cast<unsigned char>(c)];
  for (const auto& candidate : candidates) {
    // The distance is at least the difference in length, so a candidate that differs by
    // that much cannot win and is not compared: a mistyped key of megabytes (found by
    // fuzz_experiment_yaml) would otherwise fill a table of gigabytes per candidate.
    const std::size_t length_difference =
        word.size() > candidate.size() ? word.size() - candidate.size() : candidate.size() - word.size();
    if (length_difference >= best_distance) continue;
    // It is also at least the bag distance: the larger of the number of the candidate's
    // characters that `word` lacks and the number of `word`'s that the candidate lacks
    // (each edit changes either count by at most one, a swap by none). Most candidates
    // fail this test, for the cost of one pass over them.
    std::size_t unmatched = 0;  // characters of the candidate not found in word
    for (char c : candidate)
      if (--word_counts[static_cast<unsigned char>(c)] < 0) ++unmatched;
    for (char c : candidate) ++word_counts[static_cast<unsigned char>(c)];
    const std::size_t word_unmatched = word.size() - (candidate.size() - unmatched);
    if (std::max(unmatched, word_unmatched) >= best_distance) continue;
    // Only a distance below best_distance matters (NOTE [Bounded edit distance]).
    const std::size_t distance = bounded_distance(word, candidate, best_distance - 1, rows);
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

// The names suggest_config_key compares with, built once from the schema: every key and
// group (full names), and every key's last component, in schema order.
struct KeyNames {
  std::vector<std::string> full, last_components;
};

const KeyNames& key_names() {
  static const KeyNames names = [] {
    KeyNames out;
    for (const auto& key : config_schema()) {
      for (auto dot = key.name.find('.'); dot != std::string::npos; dot = key.name.find('.', dot + 1)) {
        const std::string group = key.name.substr(0, dot);
        if (std::find(out.full.begin(), out.full.end(), group) == out.full.end()) out.full.push_back(group);
      }
      out.full.push_back(key.name);
      out.last_components.emplace_back(last_component(key.name));
    }
    return out;
  }();
  return names;
}

}  // namespace

std::optional<std::string> suggest_config_key(std::string_view unknown_key) {
  const KeyNames& names = key_names();
  if (auto full = closest_match(unknown_key, names.full)) return full;
  auto component = closest_match(last_component(unknown_key), names.last_components);
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
