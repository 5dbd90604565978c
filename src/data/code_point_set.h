// A set of Unicode scalar values (0..0x10FFFF without the surrogates D800..DFFF) kept as
// sorted, disjoint, non-adjacent inclusive ranges: the character classes of tokenizer
// regexes and the Unicode properties of unicode_classes.h. Surrogates are never members;
// adding a range across them adds the scalar values on either side.
#pragma once

#include <span>
#include <vector>

#include "data/unicode_tables.h"

namespace forge {

class CodePointSet {
 public:
  using Range = unicode_tables::CodePointRange;

  CodePointSet() = default;
  explicit CodePointSet(std::span<const Range> ranges);
  static CodePointSet all();

  void add(char32_t first, char32_t last);
  void add(char32_t code_point) { add(code_point, code_point); }
  void add(const CodePointSet& other);

  bool contains(char32_t code_point) const;
  bool empty() const { return ranges_.empty(); }
  const std::vector<Range>& ranges() const { return ranges_; }

  CodePointSet complement() const;
  CodePointSet intersection(const CodePointSet& other) const;
  CodePointSet difference(const CodePointSet& other) const;
  bool operator==(const CodePointSet& other) const;

 private:
  std::vector<Range> ranges_;
};

}  // namespace forge
