#include "data/code_point_set.h"

#include <algorithm>

namespace forge {
namespace {

constexpr char32_t kSurrogateFirst = 0xD800, kSurrogateLast = 0xDFFF, kLastCodePoint = 0x10FFFF;

}  // namespace

CodePointSet::CodePointSet(std::span<const Range> ranges) {
  for (const auto& range : ranges) add(range.first, range.last);
}

CodePointSet CodePointSet::all() {
  CodePointSet set;
  set.add(0, kLastCodePoint);
  return set;
}

void CodePointSet::add(char32_t first, char32_t last) {
  last = std::min(last, kLastCodePoint);
  if (first > last) return;
  if (first <= kSurrogateLast && last >= kSurrogateFirst) {
    if (first < kSurrogateFirst) add(first, kSurrogateFirst - 1);
    if (last > kSurrogateLast) add(kSurrogateLast + 1, last);
    return;
  }
  auto begin = std::lower_bound(ranges_.begin(), ranges_.end(), first,
                                [](const Range& range, char32_t value) { return range.last + 1 < value; });
  auto end = begin;
  for (; end != ranges_.end() && end->first <= last + 1; ++end) {
    first = std::min(first, end->first);
    last = std::max(last, end->last);
  }
  ranges_.insert(ranges_.erase(begin, end), Range{first, last});
}

void CodePointSet::add(const CodePointSet& other) {
  for (const auto& range : other.ranges_) add(range.first, range.last);
}

bool CodePointSet::contains(char32_t code_point) const {
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), code_point,
                             [](char32_t value, const Range& range) { return value < range.first; });
  return it != ranges_.begin() && std::prev(it)->last >= code_point;
}

CodePointSet CodePointSet::complement() const {
  CodePointSet out;
  char32_t next = 0;
  for (const auto& range : ranges_) {
    if (range.first > next) out.add(next, range.first - 1);
    next = range.last + 1;
  }
  out.add(next, kLastCodePoint);
  return out;
}

CodePointSet CodePointSet::intersection(const CodePointSet& other) const {
  CodePointSet out;
  auto a = ranges_.begin(), b = other.ranges_.begin();
  while (a != ranges_.end() && b != other.ranges_.end()) {
    const char32_t first = std::max(a->first, b->first), last = std::min(a->last, b->last);
    if (first <= last) out.ranges_.push_back({first, last});
    if (a->last < b->last) {
      ++a;
    } else {
      ++b;
    }
  }
  return out;
}

CodePointSet CodePointSet::difference(const CodePointSet& other) const { return intersection(other.complement()); }

bool CodePointSet::operator==(const CodePointSet& other) const {
  return std::equal(ranges_.begin(), ranges_.end(), other.ranges_.begin(), other.ranges_.end(),
                    [](const Range& a, const Range& b) { return a.first == b.first && a.last == b.last; });
}

}  // namespace forge
