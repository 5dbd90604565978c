// PCRE2 syntax for a character class that must match exactly a given set of code points:
// the last step of translating a tokenizer regex (oniguruma_pattern.h). The set comes from
// tokenizers' own Unicode tables; the syntax uses PCRE2's native properties where they
// nearly agree, so matching stays nearly as fast as a plain \p{L}.
//
// NOTE [Exact classes at native speed]
// A class written as explicit code point ranges is exact whatever Unicode version PCRE2
// carries, but PCRE2 10.42 tests a code point against such a class range by range: Llama
// 3's pattern with \p{L} and \p{N} spelled out (~750 ranges) splits Latin-heavy text 4×
// and CJK text 20× slower than with PCRE2's own \p{L}, a table lookup, which however is
// Unicode 14 where tokenizers is 16. So a class keeps the native properties its items
// name (\p{L}; \p{L}\p{M}\p{Nd}\p{Pc} for \w) and forge corrects them: it asks the linked
// PCRE2 once per process which code points each native matches (one scan over every code
// point, ~12 ms, memoized), adds what the natives miss as explicit ranges inside the
// brackets, and takes out what they wrongly include: from a negated class by an
// alternative, (?:[^...]|[spurious]), from a plain one by a lookahead, (?:(?![spurious])[...]).
// The corrections are the few dozen ranges that changed between the two Unicode versions
// (none once PCRE2 carries tokenizers' version, and a lone exact native stays an escape);
// the result is exact by construction, whichever PCRE2 forge is built with. Inside the
// brackets the ranges below U+0100 come first (PCRE2 decides them with a bitmap), then the
// natives, then the other ranges. Measured on one core: the Llama 3 split alone runs at
// 0.65-0.75× the speed of the untranslated pattern, whole encodes 3-12 % slower
// (docs/PERF.md).
#pragma once

#include <string>
#include <vector>

#include "data/code_point_set.h"

namespace forge {

// One item of a class as the pattern wrote it: the code points tokenizers matches for it,
// and PCRE2 class syntax approximating it natively ("\\p{L}"), or "" to spell it out.
struct ClassItem {
  CodePointSet set;
  std::string native;
};

// The code points a class of `items` matches: their union, or its complement if `negated`.
CodePointSet class_set(const std::vector<ClassItem>& items, bool negated);

// One PCRE2 atom (for a UTF | UCP pattern) that matches exactly class_set(items, negated).
std::string pcre2_class(const std::vector<ClassItem>& items, bool negated);

}  // namespace forge
