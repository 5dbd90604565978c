// The GPT-2 byte-to-character table of byte-level BPE: every byte 0-255 is shown as one
// printable Unicode character (printable Latin-1 bytes as themselves, the others as
// U+0100 onwards in byte order), so a vocab of strings covers arbitrary bytes. The
// ByteLevel pre-tokenizer maps text through it, the ByteLevel decoder maps back.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace forge::byte_level {

// The UTF-8 text of the characters standing for each byte of `bytes`.
std::string encode(std::string_view bytes);

// The byte a code point stands for, or -1 when it stands for none.
int byte_of(int32_t code_point);

// The split pattern the ByteLevel pre-tokenizer uses when use_regex is true (GPT-2's).
inline constexpr const char* kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace forge::byte_level
