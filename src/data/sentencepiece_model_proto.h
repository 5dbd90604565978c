// The content of a SentencePiece tokenizer.model: the ModelProto message of sentencepiece's
// sentencepiece_model.proto, read with forge's own wire reader (core/protobuf_reader.h).
// Only the fields that encoding and decoding read are kept, with proto2's defaults where a
// field is absent. The rest are skipped like unknown fields: self_test_data, and the
// trainer_spec fields that only shaped training (vocab_size, split_digits,
// split_by_whitespace, allow_whitespace_only_pieces, ...: sentencepiece's encoder does not
// read them either; what they did shows in which pieces exist), the trainer's
// unk/bos/eos/pad ids (encoding finds <unk> by piece type, bos and eos by piece name), and
// normalizer_spec.name (the rules it names are in precompiled_charsmap).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

// ModelProto.SentencePiece.Type; the values are the proto's.
enum class SentencePieceType : uint8_t { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };

// TrainerSpec.ModelType; the values are the proto's.
enum class SentencePieceModelType : uint8_t { Unigram = 1, Bpe = 2, Word = 3, Char = 4 };

struct SentencePiece {
  std::string piece;
  float score = 0.0f;
  SentencePieceType type = SentencePieceType::Normal;
};

struct SentencePieceTrainerSpec {
  SentencePieceModelType model_type = SentencePieceModelType::Unigram;
  bool byte_fallback = false;
  bool treat_whitespace_as_suffix = false;
  std::string bos_piece = "<s>", eos_piece = "</s>";
  std::optional<std::string> unk_surface;  // decode's text for <unk>; " \u2047 " when absent
};

struct SentencePieceNormalizerSpec {
  std::string precompiled_charsmap;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;
};

struct SentencePieceModelProto {
  std::vector<SentencePiece> pieces;
  SentencePieceTrainerSpec trainer_spec;
  SentencePieceNormalizerSpec normalizer_spec;
  std::optional<SentencePieceNormalizerSpec> denormalizer_spec;
};

// Parses the bytes of `file`. Fails naming the file, the field and its byte offset when
// the bytes are not a ModelProto (truncated, wrong wire types, an unknown piece type or
// model type).
SentencePieceModelProto parse_sentencepiece_model(std::string_view bytes, const std::string& file);

}  // namespace forge
