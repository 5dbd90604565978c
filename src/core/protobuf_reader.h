// A protocol buffer decoder just large enough for files forge reads without their schema
// compiler (SentencePiece's tokenizer.model): fields are read one by one in the wire
// format (core/protobuf_wire.h describes it in NOTE [Protobuf wire format]), and the
// caller, which knows the schema, picks the fields it needs and skips the others, as
// protobuf itself skips unknown fields. Every error names the file, the field's path
// ("pieces[3].score"), its number and the byte offset in the file, so a truncated or
// foreign file is reported where it goes wrong instead of being read as garbage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace forge {

enum class ProtoWireType : uint8_t { Varint = 0, Fixed64 = 1, LengthDelimited = 2, Fixed32 = 5 };

struct ProtoField {
  uint32_t number = 0;
  ProtoWireType wire_type = ProtoWireType::Varint;
  uint64_t value = 0;      // Varint, Fixed64 and Fixed32 fields
  std::string_view bytes;  // LengthDelimited fields: strings, bytes, embedded messages
  size_t offset = 0;       // of the field's key, in the file
};

class ProtoReader {
 public:
  // Reads the top-level `message` (a whole file); errors start with `context`, e.g.
  // "tokenizer.model: not a valid SentencePiece model: ".
  ProtoReader(std::string_view message, std::string context);

  // The next field, or false at the end of the message. Fails on malformed wire data
  // (truncated varint or field, a length past the end, wire types 3, 4, 6 and 7).
  bool next(ProtoField& field);

  // Typed values of a field the caller recognized by number; each fails naming `name`
  // when the wire type does not fit the declared type.
  std::string_view bytes(const ProtoField& field, std::string_view name) const;
  uint64_t varint(const ProtoField& field, std::string_view name) const;
  bool boolean(const ProtoField& field, std::string_view name) const;
  float float32(const ProtoField& field, std::string_view name) const;
  // The message embedded in `field`; `name` ("trainer_spec", "pieces[3]") extends the
  // path that errors inside it name.
  ProtoReader message(const ProtoField& field, std::string_view name) const;

  // Fails naming the field's path, number and offset: "<context>pieces[3].type (field 3)
  // at byte 120: <problem>".
  [[noreturn]] void fail(const ProtoField& field, std::string_view name, std::string_view problem) const;

 private:
  ProtoReader(std::string_view message, size_t offset, std::string context, std::string path);
  [[noreturn]] void fail_at(size_t offset, std::string_view problem) const;
  uint64_t read_varint();
  void expect(const ProtoField& field, ProtoWireType type, std::string_view name) const;

  std::string_view message_;
  size_t position_ = 0;
  size_t offset_;  // of message_ in the file
  std::string context_;
  std::string path_;  // of this message from the top level, "" for the top level itself
};

}  // namespace forge
