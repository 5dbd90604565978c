// UTF-8 helpers for the tokenizers. Text reaches forge as bytes that are usually, but not
// always, valid UTF-8; every function here treats a byte that does not start a valid
// sequence as a one-byte unit of its own, so invalid input is still split, matched and
// tokenized byte by byte instead of being rejected or silently replaced.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace forge::utf8 {

// Length in bytes of the unit starting at text[pos]: a valid UTF-8 sequence (1-4 bytes)
// or 1 for an invalid byte.
size_t unit_length(std::string_view text, size_t pos);

// The code point of the unit at text[pos], or -1 when it is an invalid byte.
int32_t code_point_at(std::string_view text, size_t pos);

// The code point of the unit that ends at text[end] (exclusive), or -1 when invalid or
// end == 0.
int32_t code_point_before(std::string_view text, size_t end);

// Length in bytes of the unit that ends at text[end] (exclusive); end must be > 0.
size_t unit_length_before(std::string_view text, size_t end);

void append(std::string& out, uint32_t code_point);

// Rust's char::is_whitespace (the Unicode White_Space property).
bool is_whitespace(int32_t code_point);

}  // namespace forge::utf8
