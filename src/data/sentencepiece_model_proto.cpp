#include "data/sentencepiece_model_proto.h"

#include <fmt/format.h>

#include "core/protobuf_reader.h"

namespace forge {
namespace {

// Field numbers of sentencepiece_model.proto.
enum PieceField : uint32_t { kPiece = 1, kScore = 2, kType = 3 };
enum TrainerField : uint32_t {
  kModelType = 3,
  kTreatWhitespaceAsSuffix = 24,
  kByteFallback = 35,
  kUnkSurface = 44,
  kBosPiece = 46,
  kEosPiece = 47,
};
enum NormalizerField : uint32_t {
  kPrecompiledCharsmap = 2,
  kAddDummyPrefix = 3,
  kRemoveExtraWhitespaces = 4,
  kEscapeWhitespaces = 5,
};
enum ModelField : uint32_t { kPieces = 1, kTrainerSpec = 2, kNormalizerSpec = 3, kDenormalizerSpec = 5 };

SentencePiece parse_piece(ProtoReader reader) {
  SentencePiece piece;
  ProtoField field;
  while (reader.next(field)) {
    switch (field.number) {
      case kPiece:
        piece.piece = reader.bytes(field, "piece");
        break;
      case kScore:
        piece.score = reader.float32(field, "score");
        break;
      case kType: {
        const uint64_t type = reader.varint(field, "type");
        if (type < 1 || type > 6)
          reader.fail(field, "type", fmt::format("unknown piece type {} (expected 1-6: NORMAL, UNKNOWN, CONTROL, "
                                                 "USER_DEFINED, UNUSED, BYTE)",
                                                 type));
        piece.type = static_cast<SentencePieceType>(type);
        break;
      }
      default:
        break;
    }
  }
  return piece;
}

// Fields present in the message override `spec` one by one, as protobuf merges a message
// that appears twice.
void parse_trainer_spec(ProtoReader reader, SentencePieceTrainerSpec& spec) {
  ProtoField field;
  while (reader.next(field)) {
    switch (field.number) {
      case kModelType: {
        const uint64_t type = reader.varint(field, "model_type");
        if (type < 1 || type > 4)
          reader.fail(field, "model_type",
                      fmt::format("unknown model type {} (expected 1 UNIGRAM, 2 BPE, 3 WORD or 4 CHAR)", type));
        spec.model_type = static_cast<SentencePieceModelType>(type);
        break;
      }
      case kTreatWhitespaceAsSuffix:
        spec.treat_whitespace_as_suffix = reader.boolean(field, "treat_whitespace_as_suffix");
        break;
      case kByteFallback:
        spec.byte_fallback = reader.boolean(field, "byte_fallback");
        break;
      case kUnkSurface:
        spec.unk_surface = std::string(reader.bytes(field, "unk_surface"));
        break;
      case kBosPiece:
        spec.bos_piece = reader.bytes(field, "bos_piece");
        break;
      case kEosPiece:
        spec.eos_piece = reader.bytes(field, "eos_piece");
        break;
      default:
        break;
    }
  }
}

void parse_normalizer_spec(ProtoReader reader, SentencePieceNormalizerSpec& spec) {
  ProtoField field;
  while (reader.next(field)) {
    switch (field.number) {
      case kPrecompiledCharsmap:
        spec.precompiled_charsmap = reader.bytes(field, "precompiled_charsmap");
        break;
      case kAddDummyPrefix:
        spec.add_dummy_prefix = reader.boolean(field, "add_dummy_prefix");
        break;
      case kRemoveExtraWhitespaces:
        spec.remove_extra_whitespaces = reader.boolean(field, "remove_extra_whitespaces");
        break;
      case kEscapeWhitespaces:
        spec.escape_whitespaces = reader.boolean(field, "escape_whitespaces");
        break;
      default:
        break;
    }
  }
}

}  // namespace

SentencePieceModelProto parse_sentencepiece_model(std::string_view bytes, const std::string& file) {
  SentencePieceModelProto model;
  ProtoReader reader(bytes, fmt::format("{}: not a valid SentencePiece model: ", file));
  ProtoField field;
  while (reader.next(field)) {
    switch (field.number) {
      case kPieces:
        model.pieces.push_back(parse_piece(reader.message(field, fmt::format("pieces[{}]", model.pieces.size()))));
        break;
      case kTrainerSpec:
        parse_trainer_spec(reader.message(field, "trainer_spec"), model.trainer_spec);
        break;
      case kNormalizerSpec:
        parse_normalizer_spec(reader.message(field, "normalizer_spec"), model.normalizer_spec);
        break;
      case kDenormalizerSpec:
        if (!model.denormalizer_spec) model.denormalizer_spec.emplace();
        parse_normalizer_spec(reader.message(field, "denormalizer_spec"), *model.denormalizer_spec);
        break;
      default:
        break;
    }
  }
  return model;
}

}  // namespace forge
