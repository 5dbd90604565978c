#include "data/unicode_classes.h"

#include <algorithm>
#include <array>
#include <span>

namespace forge::unicode {
namespace {

using unicode_tables::CodePointRange;

constexpr std::array<std::string_view, 30> kCategoryNames = {
    "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe",
    "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"};

// The code points whose general category `wanted` accepts.
template <typename Predicate>
CodePointSet categories(Predicate wanted) {
  const auto runs = unicode_tables::general_category_runs;
  CodePointSet set;
  for (size_t i = 0; i < runs.size(); ++i) {
    const char32_t last = i + 1 < runs.size() ? runs[i + 1].first - 1 : 0x10FFFF;
    if (wanted(kCategoryNames[static_cast<size_t>(runs[i].category)])) set.add(runs[i].first, last);
  }
  return set;
}

bool in_ranges(std::span<const CodePointRange> ranges, int32_t code_point) {
  if (code_point < 0) return false;
  const auto c = static_cast<char32_t>(code_point);
  auto it = std::upper_bound(ranges.begin(), ranges.end(), c,
                             [](char32_t value, const CodePointRange& range) { return value < range.first; });
  return it != ranges.begin() && std::prev(it)->last >= c;
}

}  // namespace

std::optional<CodePointSet> property(std::string_view name) {
  if (name == "Any") return CodePointSet::all();
  if (name == "LC") return categories([](std::string_view c) { return c == "Lu" || c == "Ll" || c == "Lt"; });
  if (name.size() == 1 && std::string_view("LMNPSZC").find(name[0]) != std::string_view::npos)
    return categories([&](std::string_view c) { return c[0] == name[0]; });
  if (std::find(kCategoryNames.begin(), kCategoryNames.end(), name) != kCategoryNames.end())
    return categories([&](std::string_view c) { return c == name; });
  return std::nullopt;
}

CodePointSet regex_space() { return CodePointSet(unicode_tables::regex_space); }

CodePointSet regex_word(bool in_class) {
  CodePointSet word(unicode_tables::regex_word);
  if (!in_class) word.add(CodePointSet(unicode_tables::regex_word_outside_class_only));
  return word;
}

CodePointSet regex_digit() { return categories([](std::string_view c) { return c == "Nd"; }); }

bool is_numeric(int32_t code_point) { return in_ranges(unicode_tables::numeric, code_point); }

bool is_added_token_word_character(int32_t code_point) {
  return in_ranges(unicode_tables::added_token_word, code_point);
}

}  // namespace forge::unicode
