// Translating a tokenizer.json regex from the dialect Hugging Face tokenizers compiles it in
// (Oniguruma, with its default "Oniguruma" syntax) into a PCRE2 pattern that matches the
// same text, for TokenizerRegex.
//
// NOTE [Oniguruma patterns in PCRE2]
// tokenizers runs Split, Replace and ByteLevel's regexes through Oniguruma (the onig crate)
// with Unicode 16 tables (tokenizers 0.23); forge runs them through PCRE2 10.42 (Debian 12)
// for its JIT, with Unicode 14 tables. Handed the same pattern the two engines disagree:
//   - \s: PCRE2 also matches U+180E MONGOLIAN VOWEL SEPARATOR (not White_Space since
//     Unicode 6.3), so "  \u180e" split differently;
//   - \w: Oniguruma's is letters, marks, Nd, Pc and the other Alphabetic characters (Nl,
//     circled letters, ...), and outside a class also ² ³ ¹ ¼ ½ ¾ ([\w] lacks them);
//     PCRE2's is L, N and _ (so \b differs too); \d is Nd in both;
//   - \h is a hex digit in Oniguruma, horizontal space in PCRE2; \v is the VT character in
//     Oniguruma, any vertical space in PCRE2;
//   - \p{..}: every letter, digit and mark added in Unicode 15, 15.1 and 16 (CJK Extension
//     I, Kawi, Garay, Todhri, ...) and the few characters whose category changed;
//   - ^ and $ are line anchors in Oniguruma; (?m) is its dot-all; an option written alone,
//     a(?i)b|c, runs to the end of its group and takes the alternatives with it
//     (a(?i:b|c)); classes nest ([a[bc]]) and intersect ([a-z&&[^aeiou]]); {,n} is {0,n};
//     a quantifier after {n} or {n,m}+ repeats the repeat; case-insensitive "ss" also
//     matches ß.
// So forge translates. Every class — bracketed, \s \w \d \h and their negations, \p{..} and
// \P{..} — becomes the exact set of code points tokenizers matches, taken from
// unicode_tables.cpp (probed from tokenizers itself by scripts/generate-unicode-tables)
// and written out by pcre2_class (NOTE [Exact classes at native speed]); the anchors,
// options, groups and quantifiers above are rewritten to their PCRE2 equivalents (the
// pattern is compiled with PCRE2_MULTILINE and LF newlines); literals, alternation and
// lookaround pass through. What forge does not translate is refused when the tokenizer
// loads, naming the file, the component, the pattern and the construct, never run with
// another meaning: \p{..} other than a general category by its short name (L, Lu, LC,
// ..., Cn) or Any; POSIX brackets; backreferences and subroutine calls; \G \K \X \y \Q
// \c and octal escapes other than \0; options other than i and m; absent groups,
// conditionals and callouts; and inside a case-insensitive group anything but ASCII
// literals (no classes, and no pair such as "ss" that Oniguruma folds to one character).
// Published patterns (Llama 3, GPT-2, GPT-4o, Qwen, DeepSeek, BLOOM) need none of those.
#pragma once

#include <string>
#include <string_view>

namespace forge {

// A PCRE2 pattern, for PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE with LF newlines, that
// matches what tokenizers' Oniguruma matches with `pattern`. Throws forge::Error naming
// `file`, `where`, the pattern and the offending construct when it cannot.
std::string oniguruma_to_pcre2(std::string_view pattern, const std::string& file, const std::string& where);

}  // namespace forge
