// CRC-32 (the IEEE 802.3 polynomial, reflected, as zlib's crc32 and Python's
// zlib.crc32 compute it) over a byte range: the checksum each tensor piece of a
// checkpoint carries, so a flipped bit on disk is caught and named on load.
#pragma once

#include <cstddef>
#include <cstdint>

namespace forge {

// crc of bytes [data, data + size), continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t size, uint32_t crc = 0);
// The crc of A followed by B, from crc32(A), crc32(B) and B's length (zlib's
// crc32_combine): a piece written in parts, in any order, gets the checksum of its bytes.
uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, int64_t size_b);

}  // namespace forge
