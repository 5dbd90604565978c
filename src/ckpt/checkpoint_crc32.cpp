// Table-driven CRC-32: one 256-entry table of the remainders of each byte value,
// built once at compile time; the loop folds one byte per iteration.
#include "ckpt/checkpoint_crc32.h"

#include <zlib.h>

#include <array>

namespace forge {
namespace {

constexpr uint32_t kReflectedPolynomial = 0xEDB88320u;

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t r = byte;
    for (int bit = 0; bit < 8; ++bit) r = (r & 1u) ? (r >> 1) ^ kReflectedPolynomial : r >> 1;
    table[byte] = r;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = make_table();

}  // namespace

uint32_t crc32(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = kTable[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, int64_t size_b) {
  return static_cast<uint32_t>(::crc32_combine64(crc_a, crc_b, static_cast<z_off64_t>(size_b)));
}

}  // namespace forge
