// The pieces of the TensorBoard writer: CRC-32C against the published test vectors (RFC
// 3720, appendix B.4), the masked CRC TFRecords carry, the record framing, and the
// protobuf wire encoding. tests/python/test_tensorboard.py reads whole event files back
// with TensorBoard's own reader.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "core/protobuf_wire.h"
#include "train/tfrecord.h"

namespace forge {
namespace {

std::string bytes(std::initializer_list<int> values) {
  std::string out;
  for (int v : values) out.push_back(static_cast<char>(v));
  return out;
}

std::string varint(uint64_t value) {
  std::string out;
  append_varint(out, value);
  return out;
}

TEST(TensorBoard, Crc32cKnownVectors) {
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
}

TEST(TensorBoard, MaskedCrc32c) {
  // The values TensorBoard's record writer computes for the same bytes.
  EXPECT_EQ(masked_crc32c(""), 0xa282ead8u);
  EXPECT_EQ(masked_crc32c("123456789"), 0xc78ab0e5u);
}

TEST(TensorBoard, RecordFraming) {
  const std::string record = tfrecord("123456789");
  ASSERT_EQ(record.size(), 8u + 4u + 9u + 4u);
  uint64_t length;
  uint32_t length_crc, data_crc;
  std::memcpy(&length, record.data(), 8);
  std::memcpy(&length_crc, record.data() + 8, 4);
  std::memcpy(&data_crc, record.data() + 21, 4);
  EXPECT_EQ(length, 9u);
  EXPECT_EQ(length_crc, masked_crc32c(record.substr(0, 8)));
  EXPECT_EQ(record.substr(12, 9), "123456789");
  EXPECT_EQ(data_crc, 0xc78ab0e5u);
}

TEST(TensorBoard, Varints) {
  EXPECT_EQ(varint(0), bytes({0x00}));
  EXPECT_EQ(varint(1), bytes({0x01}));
  EXPECT_EQ(varint(127), bytes({0x7f}));
  EXPECT_EQ(varint(128), bytes({0x80, 0x01}));
  EXPECT_EQ(varint(150), bytes({0x96, 0x01}));  // the protobuf documentation's example
  EXPECT_EQ(varint(300), bytes({0xac, 0x02}));
  EXPECT_EQ(varint(UINT64_MAX), bytes({0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}));
}

TEST(TensorBoard, ProtoFields) {
  ProtoWriter w;
  w.add_varint(2, 150);     // key (2 << 3 | 0)
  w.add_double(1, 1.0);     // key (1 << 3 | 1), 8 bytes little-endian
  w.add_float(2, 1.0f);     // key (2 << 3 | 5), 4 bytes little-endian
  w.add_bytes(3, "ab");     // key (3 << 3 | 2), length, bytes
  w.add_bytes(20, "");      // a two-byte key: 20 << 3 | 2 = 162
  EXPECT_EQ(w.bytes(), bytes({0x10, 0x96, 0x01,                                      //
                              0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, 0x3f,  //
                              0x15, 0x00, 0x00, 0x80, 0x3f,                          //
                              0x1a, 0x02, 'a', 'b',                                  //
                              0xa2, 0x01, 0x00}));
}

}  // namespace
}  // namespace forge
