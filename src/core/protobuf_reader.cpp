#include "core/protobuf_reader.h"

#include <bit>
#include <cstring>

#include "core/error.h"

namespace forge {

static_assert(std::endian::native == std::endian::little, "fixed-width fields are copied as little-endian bytes");

namespace {

const char* wire_type_name(ProtoWireType type) {
  switch (type) {
    case ProtoWireType::Varint:
      return "varint";
    case ProtoWireType::Fixed64:
      return "fixed64";
    case ProtoWireType::LengthDelimited:
      return "length-delimited";
    case ProtoWireType::Fixed32:
      return "fixed32";
  }
  return "unknown";
}

}  // namespace

ProtoReader::ProtoReader(std::string_view message, std::string context)
    : ProtoReader(message, 0, std::move(context), "") {}

ProtoReader::ProtoReader(std::string_view message, size_t offset, std::string context, std::string path)
    : message_(message), offset_(offset), context_(std::move(context)), path_(std::move(path)) {}

void ProtoReader::fail_at(size_t offset, std::string_view problem) const {
  FORGE_FAIL("{}byte {}{}: {}", context_, offset, path_.empty() ? "" : " (in " + path_ + ")", problem);
}

void ProtoReader::fail(const ProtoField& field, std::string_view name, std::string_view problem) const {
  FORGE_FAIL("{}{}{}{} (field {}) at byte {}: {}", context_, path_, path_.empty() ? "" : ".", name, field.number,
             field.offset, problem);
}

uint64_t ProtoReader::read_varint() {
  const size_t start = position_;
  uint64_t value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (position_ >= message_.size()) fail_at(offset_ + start, "the message ends inside a varint");
    const auto byte = static_cast<uint8_t>(message_[position_++]);
    value |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if (!(byte & 0x80)) return value;
  }
  fail_at(offset_ + start, "a varint longer than 10 bytes");
}

bool ProtoReader::next(ProtoField& field) {
  if (position_ >= message_.size()) return false;
  field = ProtoField{};
  field.offset = offset_ + position_;
  const uint64_t key = read_varint();
  const uint64_t number = key >> 3;
  if (number == 0 || number > 0x1FFFFFFF) fail_at(field.offset, fmt::format("invalid field number {}", number));
  field.number = static_cast<uint32_t>(number);
  const auto wire_type = static_cast<uint32_t>(key & 7);
  auto take = [&](uint64_t length) {
    if (length > message_.size() - position_)
      fail_at(field.offset, fmt::format("field {} needs {} bytes but the message has {} left", field.number, length,
                                        message_.size() - position_));
    const std::string_view taken = message_.substr(position_, length);
    position_ += length;
    return taken;
  };
  switch (wire_type) {
    case 0:
      field.wire_type = ProtoWireType::Varint;
      field.value = read_varint();
      return true;
    case 1:
      field.wire_type = ProtoWireType::Fixed64;
      std::memcpy(&field.value, take(8).data(), 8);
      return true;
    case 2:
      field.wire_type = ProtoWireType::LengthDelimited;
      field.bytes = take(read_varint());
      return true;
    case 5: {
      field.wire_type = ProtoWireType::Fixed32;
      uint32_t value;
      std::memcpy(&value, take(4).data(), 4);
      field.value = value;
      return true;
    }
    default:
      fail_at(field.offset, fmt::format("field {} has wire type {}, which is not a valid protobuf field encoding "
                                        "(groups are not supported)",
                                        field.number, wire_type));
  }
}

void ProtoReader::expect(const ProtoField& field, ProtoWireType type, std::string_view name) const {
  if (field.wire_type != type)
    fail(field, name, fmt::format("expected wire type {} ({}), found {} ({})", static_cast<int>(type),
                                  wire_type_name(type), static_cast<int>(field.wire_type),
                                  wire_type_name(field.wire_type)));
}

std::string_view ProtoReader::bytes(const ProtoField& field, std::string_view name) const {
  expect(field, ProtoWireType::LengthDelimited, name);
  return field.bytes;
}

uint64_t ProtoReader::varint(const ProtoField& field, std::string_view name) const {
  expect(field, ProtoWireType::Varint, name);
  return field.value;
}

bool ProtoReader::boolean(const ProtoField& field, std::string_view name) const {
  return varint(field, name) != 0;
}

float ProtoReader::float32(const ProtoField& field, std::string_view name) const {
  expect(field, ProtoWireType::Fixed32, name);
  const auto bits = static_cast<uint32_t>(field.value);
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

ProtoReader ProtoReader::message(const ProtoField& field, std::string_view name) const {
  expect(field, ProtoWireType::LengthDelimited, name);
  const size_t start = static_cast<size_t>(field.bytes.data() - message_.data()) + offset_;
  return ProtoReader(field.bytes, start, context_, path_.empty() ? std::string(name) : path_ + "." + std::string(name));
}

}  // namespace forge
