#include "train/tfrecord.h"

#include <array>
#include <bit>

namespace forge {

static_assert(std::endian::native == std::endian::little, "the length and CRCs are copied as little-endian bytes");

namespace {

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;
constexpr uint32_t kMaskDelta = 0xa282ead8u;

// The byte-at-a-time table: entry b is the CRC register after shifting byte b through.
constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t crc = b;
    for (int bit = 0; bit < 8; ++bit) crc = crc & 1 ? (crc >> 1) ^ kCastagnoliReflected : crc >> 1;
    table[b] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = make_table();

template <typename T>
std::string_view bytes_of(const T& value) {
  return {reinterpret_cast<const char*>(&value), sizeof(T)};
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char c : data) crc = kTable[(crc ^ c) & 0xff] ^ (crc >> 8);
  return crc ^ 0xffffffffu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + kMaskDelta;
}

std::string tfrecord(std::string_view data) {
  const uint64_t length = data.size();
  const uint32_t length_crc = masked_crc32c(bytes_of(length));
  const uint32_t data_crc = masked_crc32c(data);
  std::string record;
  record.reserve(sizeof(length) + 2 * sizeof(uint32_t) + data.size());
  record.append(bytes_of(length));
  record.append(bytes_of(length_crc));
  record.append(data);
  record.append(bytes_of(data_crc));
  return record;
}

}  // namespace forge
