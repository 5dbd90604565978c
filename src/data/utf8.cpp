#include "data/utf8.h"

namespace forge::utf8 {
namespace {

bool is_continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

// Decodes the sequence at text[pos]; returns its length and stores the code point, or
// returns 0 when the bytes there are not a valid, shortest-form sequence.
size_t decode(std::string_view text, size_t pos, int32_t& code_point) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data()) + pos;
  const size_t left = text.size() - pos;
  const unsigned char c = s[0];
  if (c < 0x80) {
    code_point = c;
    return 1;
  }
  size_t length;
  int32_t value, minimum;
  if ((c & 0xE0) == 0xC0) {
    length = 2, value = c & 0x1F, minimum = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    length = 3, value = c & 0x0F, minimum = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    length = 4, value = c & 0x07, minimum = 0x10000;
  } else {
    return 0;
  }
  if (left < length) return 0;
  for (size_t i = 1; i < length; ++i) {
    if (!is_continuation(s[i])) return 0;
    value = (value << 6) | (s[i] & 0x3F);
  }
  if (value < minimum || value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF)) return 0;
  code_point = value;
  return length;
}

}  // namespace

size_t unit_length(std::string_view text, size_t pos) {
  int32_t code_point;
  const size_t length = decode(text, pos, code_point);
  return length == 0 ? 1 : length;
}

int32_t code_point_at(std::string_view text, size_t pos) {
  int32_t code_point;
  return decode(text, pos, code_point) == 0 ? -1 : code_point;
}

int32_t code_point_before(std::string_view text, size_t end) {
  if (end == 0) return -1;
  return code_point_at(text, end - unit_length_before(text, end));
}

size_t unit_length_before(std::string_view text, size_t end) {
  for (size_t back = 1; back <= 4 && back <= end; ++back) {
    int32_t code_point;
    if (decode(text, end - back, code_point) == back) return back;
  }
  return 1;
}

void append(std::string& out, uint32_t code_point) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (code_point >> 18));
    out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
}

bool is_whitespace(int32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

}  // namespace forge::utf8
