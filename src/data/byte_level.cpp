#include "data/byte_level.h"

#include <array>

#include "data/utf8.h"

namespace forge::byte_level {
namespace {

struct Tables {
  std::array<std::string, 256> chars;
  std::array<int, 512> bytes;  // every code point of the table is below 0x200
  Tables() {
    bytes.fill(-1);
    int next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const int code_point = printable ? b : next_extra++;
      utf8::append(chars[b], static_cast<uint32_t>(code_point));
      bytes[code_point] = b;
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

std::string encode(std::string_view bytes) {
  const auto& chars = tables().chars;
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += chars[static_cast<uint8_t>(c)];
  return out;
}

int byte_of(int32_t code_point) {
  if (code_point < 0 || code_point >= 512) return -1;
  return tables().bytes[code_point];
}

}  // namespace forge::byte_level
