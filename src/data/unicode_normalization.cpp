// NFC and Lowercase; see unicode_normalization.h (NOTE [NFC and Lowercase as tokenizers
// runs them]).
#include "data/unicode_normalization.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "data/unicode_normalization_tables.h"
#include "data/utf8.h"

namespace forge::unicode {
namespace {

namespace tables = unicode_normalization_tables;

constexpr int32_t kHangulFirst = 0xAC00, kHangulCount = 11172;
constexpr int32_t kLeadFirst = 0x1100, kVowelFirst = 0x1161, kTrailBase = 0x11A7;
constexpr int32_t kVowels = 21, kTrails = 28, kLeads = 19;

// A unit of the text being normalized: a code point, or -1 - b for an invalid byte b.
using Unit = int32_t;

bool is_byte(Unit u) { return u < 0; }

uint8_t combining_class(Unit u) {
  if (u < 0x300) return 0;
  const auto& ranges = tables::combining_classes;
  auto it = std::upper_bound(ranges.begin(), ranges.end(), static_cast<char32_t>(u),
                             [](char32_t c, const tables::CombiningClassRange& r) { return c < r.first; });
  if (it == ranges.begin()) return 0;
  --it;
  return static_cast<char32_t>(u) <= it->last ? it->value : 0;
}

void decompose(Unit u, std::vector<Unit>& out) {
  if (u >= kHangulFirst && u < kHangulFirst + kHangulCount) {
    const int32_t index = u - kHangulFirst;
    out.push_back(kLeadFirst + index / (kVowels * kTrails));
    out.push_back(kVowelFirst + index % (kVowels * kTrails) / kTrails);
    if (index % kTrails) out.push_back(kTrailBase + index % kTrails);
    return;
  }
  if (u >= 0xC0) {
    const auto& table = tables::decompositions;
    auto it = std::lower_bound(table.begin(), table.end(), static_cast<char32_t>(u),
                               [](const tables::Decomposition& d, char32_t c) { return d.code_point < c; });
    if (it != table.end() && it->code_point == static_cast<char32_t>(u)) {
      for (int i = 0; i < it->length; ++i)
        out.push_back(static_cast<Unit>(tables::decomposed_code_points[it->offset + i]));
      return;
    }
  }
  out.push_back(u);
}

std::optional<Unit> compose(Unit first, Unit second) {
  if (is_byte(first) || is_byte(second)) return std::nullopt;
  if (first >= kLeadFirst && first < kLeadFirst + kLeads && second >= kVowelFirst && second < kVowelFirst + kVowels)
    return kHangulFirst + ((first - kLeadFirst) * kVowels + (second - kVowelFirst)) * kTrails;
  if (first >= kHangulFirst && first < kHangulFirst + kHangulCount && (first - kHangulFirst) % kTrails == 0 &&
      second > kTrailBase && second < kTrailBase + kTrails)
    return first + (second - kTrailBase);
  const auto& table = tables::compositions;
  const auto key = std::make_pair(static_cast<char32_t>(first), static_cast<char32_t>(second));
  auto it = std::lower_bound(table.begin(), table.end(), key, [](const tables::Composition& c, const auto& k) {
    return std::make_pair(c.first, c.second) < k;
  });
  if (it != table.end() && it->first == key.first && it->second == key.second)
    return static_cast<Unit>(it->composed);
  return std::nullopt;
}

std::vector<Unit> units_of(const std::string& text) {
  std::vector<Unit> units;
  units.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const int32_t cp = utf8::code_point_at(text, pos);
    units.push_back(cp >= 0 ? cp : -1 - static_cast<uint8_t>(text[pos]));
    pos += utf8::unit_length(text, pos);
  }
  return units;
}

std::string text_of(const std::vector<Unit>& units) {
  std::string out;
  out.reserve(units.size());
  for (Unit u : units) {
    if (is_byte(u))
      out.push_back(static_cast<char>(-1 - u));
    else
      utf8::append(out, static_cast<uint32_t>(u));
  }
  return out;
}

bool all_ascii(const std::string& text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; });
}

}  // namespace

void nfc(std::string& text) {
  if (all_ascii(text)) return;  // ASCII neither decomposes nor composes
  std::vector<Unit> decomposed;
  decomposed.reserve(text.size());
  for (Unit u : units_of(text)) {
    if (is_byte(u))
      decomposed.push_back(u);
    else
      decompose(u, decomposed);
  }
  // Canonical order: each run of marks sorted by class, equal classes in text order.
  for (size_t i = 0; i < decomposed.size();) {
    if (combining_class(decomposed[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < decomposed.size() && combining_class(decomposed[end]) != 0) ++end;
    std::stable_sort(decomposed.begin() + static_cast<std::ptrdiff_t>(i),
                     decomposed.begin() + static_cast<std::ptrdiff_t>(end),
                     [](Unit a, Unit b) { return combining_class(a) < combining_class(b); });
    i = end;
  }
  // Composition: `starter` is the index of the last starter in `out` (-1: none yet),
  // `last_class` the class of the last code point kept after it (-1: none, adjacent).
  std::vector<Unit> out;
  out.reserve(decomposed.size());
  std::ptrdiff_t starter = -1;
  int last_class = -1;
  for (Unit u : decomposed) {
    const int cls = combining_class(u);
    if (starter < 0) {
      out.push_back(u);
      if (cls == 0) starter = static_cast<std::ptrdiff_t>(out.size()) - 1, last_class = -1;
      continue;
    }
    if (last_class < cls) {  // not blocked (last_class -1: right after the starter)
      if (auto composed = compose(out[static_cast<size_t>(starter)], u)) {
        out[static_cast<size_t>(starter)] = *composed;
        continue;
      }
    }
    out.push_back(u);
    if (cls == 0)
      starter = static_cast<std::ptrdiff_t>(out.size()) - 1, last_class = -1;
    else
      last_class = cls;
  }
  text = text_of(out);
}

void lowercase(std::string& text) {
  if (all_ascii(text)) {
    for (char& c : text)
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    return;
  }
  std::string out;
  out.reserve(text.size());
  const auto& table = tables::lowercase;
  for (size_t pos = 0; pos < text.size();) {
    const size_t length = utf8::unit_length(text, pos);
    const int32_t cp = utf8::code_point_at(text, pos);
    auto it = cp < 0 ? table.end()
                     : std::lower_bound(table.begin(), table.end(), static_cast<char32_t>(cp),
                                        [](const tables::LowercaseMapping& m, char32_t c) { return m.from < c; });
    if (it != table.end() && it->from == static_cast<char32_t>(cp)) {
      utf8::append(out, it->to);
      if (it->to2) utf8::append(out, it->to2);
    } else {
      out.append(text, pos, length);
    }
    pos += length;
  }
  text = std::move(out);
}

}  // namespace forge::unicode
