// The Unicode classes of Hugging Face tokenizers (unicode_tables.h) as forge uses them: the
// sets behind its regexes' \p{..}, \s, \w and \d, and the two per-character predicates
// tokenizers applies outside its regexes.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "data/code_point_set.h"

namespace forge::unicode {

// \p{name} for a general category by its short name (L, Lu, ..., LC, ..., Cn) or Any;
// nullopt for any other name.
std::optional<CodePointSet> property(std::string_view name);

CodePointSet regex_space();  // \s: White_Space
// \w: Oniguruma's has ² ³ ¹ ¼ ½ ¾ outside a class ("\w") but not inside one ("[\w]").
CodePointSet regex_word(bool in_class);
CodePointSet regex_digit();  // \d: Nd

// The Digits pre-tokenizer's digits (Rust's char::is_numeric); false for -1 (an invalid byte).
bool is_numeric(int32_t code_point);

// Whether a single_word added token next to this character is not matched (the regex
// crate's \w); false for -1 (an invalid byte).
bool is_added_token_word_character(int32_t code_point);

}  // namespace forge::unicode
