// A protocol buffer encoder just large enough for TensorBoard's event files (and the tests
// that build SentencePiece models by hand): fields are appended one by one in the wire
// format, and an embedded message is a finished ProtoWriter's bytes added as a
// length-delimited field. No schema, no reflection; train/tensorboard_writer.cpp names the
// fields it writes, and core/protobuf_reader.h decodes the same format.
//
// NOTE [Protobuf wire format]
// A message is a sequence of fields, each a key varint (field_number << 3 | wire_type)
// followed by the value. Wire types used here: 0 varint (int64, enum; base-128, low
// group first, high bit set on every byte but the last), 1 fixed64 (double, 8 bytes
// little-endian), 2 length-delimited (string, bytes, embedded message: a varint length,
// then the bytes), 5 fixed32 (float, 4 bytes little-endian). Negative int64 values take
// ten bytes; nothing here writes one.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace forge {

// Base-128 varint, as NOTE [Protobuf wire format] describes.
void append_varint(std::string& out, uint64_t value);

class ProtoWriter {
 public:
  void add_varint(int field, uint64_t value);
  void add_double(int field, double value);
  void add_float(int field, float value);
  void add_bytes(int field, std::string_view value);  // strings and embedded messages
  const std::string& bytes() const { return bytes_; }

 private:
  void add_key(int field, int wire_type);
  std::string bytes_;
};

}  // namespace forge
