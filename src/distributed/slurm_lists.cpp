#include "distributed/slurm_lists.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdint>

#include "core/error.h"

namespace forge {
namespace {

// Large allocations are thousands of nodes; a list that expands past this is a typo.
constexpr size_t kMaxExpandedNames = 1 << 20;

bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

uint64_t parse_count(std::string_view digits, std::string_view list, std::string_view variable) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (!all_digits(digits) || ec != std::errc() || end != digits.data() + digits.size() || value > 1'000'000'000)
    FORGE_FAIL("{}='{}': expected a number, got '{}'", variable, list, digits);
  return value;
}

// Splits at commas outside brackets.
std::vector<std::string_view> split_top_level(std::string_view list, std::string_view variable) {
  std::vector<std::string_view> parts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    const char c = i < list.size() ? list[i] : ',';
    if (c == '[' && ++depth > 1) FORGE_FAIL("{}='{}': nested '['", variable, list);
    if (c == ']' && --depth < 0) FORGE_FAIL("{}='{}': ']' without '['", variable, list);
    if (c == ',' && depth == 0) {
      if (i == start) FORGE_FAIL("{}='{}': empty entry", variable, list);
      parts.push_back(list.substr(start, i - start));
      start = i + 1;
    }
  }
  if (depth != 0) FORGE_FAIL("{}='{}': '[' without ']'", variable, list);
  return parts;
}

// The names one bracket stands for: "01-04,07" -> 01 02 03 04 07.
std::vector<std::string> expand_bracket(std::string_view inside, std::string_view list, std::string_view variable) {
  std::vector<std::string> names;
  size_t start = 0;
  for (size_t i = 0; i <= inside.size(); ++i) {
    if (i < inside.size() && inside[i] != ',') continue;
    const std::string_view item = inside.substr(start, i - start);
    start = i + 1;
    const size_t dash = item.find('-');
    const std::string_view low = item.substr(0, dash);
    const std::string_view high = dash == std::string_view::npos ? low : item.substr(dash + 1);
    const uint64_t from = parse_count(low, list, variable);
    const uint64_t to = parse_count(high, list, variable);
    if (to < from) FORGE_FAIL("{}='{}': range '{}' runs backwards", variable, list, item);
    if (names.size() + (to - from) >= kMaxExpandedNames)
      FORGE_FAIL("{}='{}': expands to more than {} names", variable, list, kMaxExpandedNames);
    for (uint64_t n = from; n <= to; ++n) names.push_back(fmt::format("{:0{}}", n, low.size()));
  }
  return names;
}

}  // namespace

std::vector<std::string> expand_hostlist(std::string_view list, std::string_view variable) {
  if (list.empty()) FORGE_FAIL("{} is empty: expected a Slurm hostlist such as 'gpu[01-04]'", variable);
  std::vector<std::string> hosts;
  for (std::string_view pattern : split_top_level(list, variable)) {
    std::vector<std::string> names{""};
    size_t pos = 0;
    while (pos < pattern.size()) {
      const size_t open = pattern.find('[', pos);
      const std::string_view literal = pattern.substr(pos, open == std::string_view::npos ? open : open - pos);
      for (std::string& name : names) name += literal;
      if (open == std::string_view::npos) break;
      const size_t close = pattern.find(']', open);
      const std::vector<std::string> choices =
          expand_bracket(pattern.substr(open + 1, close - open - 1), list, variable);
      if (names.size() * choices.size() + hosts.size() > kMaxExpandedNames)
        FORGE_FAIL("{}='{}': expands to more than {} names", variable, list, kMaxExpandedNames);
      std::vector<std::string> combined;
      combined.reserve(names.size() * choices.size());
      for (const std::string& name : names)
        for (const std::string& choice : choices) combined.push_back(name + choice);
      names = std::move(combined);
      pos = close + 1;
    }
    hosts.insert(hosts.end(), names.begin(), names.end());
  }
  return hosts;
}

std::vector<int> expand_tasks_per_node(std::string_view list, std::string_view variable) {
  if (list.empty()) FORGE_FAIL("{} is empty: expected task counts such as '4(x2),3'", variable);
  std::vector<int> counts;
  for (std::string_view entry : split_top_level(list, variable)) {
    const size_t paren = entry.find('(');
    const uint64_t count = parse_count(entry.substr(0, paren), list, variable);
    uint64_t repeat = 1;
    if (paren != std::string_view::npos) {
      if (!entry.ends_with(')') || entry.substr(paren + 1, 1) != "x")
        FORGE_FAIL("{}='{}': expected N or N(xM), got '{}'", variable, list, entry);
      repeat = parse_count(entry.substr(paren + 2, entry.size() - paren - 3), list, variable);
    }
    if (counts.size() + repeat > kMaxExpandedNames)
      FORGE_FAIL("{}='{}': expands to more than {} nodes", variable, list, kMaxExpandedNames);
    counts.insert(counts.end(), repeat, static_cast<int>(count));
  }
  return counts;
}

}  // namespace forge
