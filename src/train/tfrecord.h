// TFRecord framing, the container of TensorBoard event files: each record is
//
//   uint64 length | uint32 masked CRC-32C of the length | data | uint32 masked CRC-32C of the data
//
// all little-endian. CRC-32C is the Castagnoli polynomial (reflected 0x82F63B78, as in
// iSCSI and ext4), not the zlib CRC-32 of checkpoints. The "mask" rotates the CRC right by
// 15 bits and adds 0xa282ead8, so that a CRC computed over data that itself holds CRCs
// does not degenerate.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace forge {

uint32_t crc32c(std::string_view data);
uint32_t masked_crc32c(std::string_view data);
// One framed record holding `data`.
std::string tfrecord(std::string_view data);

}  // namespace forge
