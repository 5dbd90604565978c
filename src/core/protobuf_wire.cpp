#include "core/protobuf_wire.h"

#include <bit>
#include <cstring>

namespace forge {

static_assert(std::endian::native == std::endian::little, "fixed-width fields are copied as little-endian bytes");

namespace {

enum WireType { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

template <typename T>
void append_raw(std::string& out, T value) {
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}

}  // namespace

void append_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void ProtoWriter::add_key(int field, int wire_type) {
  append_varint(bytes_, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}

void ProtoWriter::add_varint(int field, uint64_t value) {
  add_key(field, kVarint);
  append_varint(bytes_, value);
}

void ProtoWriter::add_double(int field, double value) {
  add_key(field, kFixed64);
  append_raw(bytes_, value);
}

void ProtoWriter::add_float(int field, float value) {
  add_key(field, kFixed32);
  append_raw(bytes_, value);
}

void ProtoWriter::add_bytes(int field, std::string_view value) {
  add_key(field, kLengthDelimited);
  append_varint(bytes_, value.size());
  bytes_.append(value);
}

}  // namespace forge
