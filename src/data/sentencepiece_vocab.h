// The pieces of a SentencePiece model and what encoding does with each kind, as
// sentencepiece's ModelInterface and SentencePieceProcessor define it:
//   NORMAL, USER_DEFINED, UNUSED  "text pieces": what BPE merges into and unigram segments
//                                 into (not UNUSED ones; USER_DEFINED ones are also matched whole
//                                 in the text before anything else, NOTE
//                                 [SentencePiece normalization])
//   CONTROL (<s>, </s>)           never produced from text; decode to nothing
//   UNKNOWN (exactly one, <unk>)  what text no piece covers becomes
//   BYTE (<0x00>..<0xFF>)         with byte_fallback, what unknown text becomes instead
// Looking a string up (sentencepiece's PieceToId) tries CONTROL, UNKNOWN and BYTE pieces
// first, then text pieces, and gives the unknown id when neither has it.
//
// NOTE [Unknown pieces]
// A piece of the normalized text that the model could only call unknown (a character no
// piece covers) becomes, with byte_fallback, one <0xNN> id per UTF-8 byte of it;
// without, it becomes the <unk> id, and a run of unknown pieces becomes a single <unk>
// (sentencepiece merges them so that decode shows one " ⁇ " per run).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/sentencepiece_model_proto.h"
#include "data/string_map.h"

namespace forge {

// NORMAL, USER_DEFINED and UNUSED pieces.
bool is_text_piece(SentencePieceType type);

class SentencePieceVocab {
 public:
  // Checks the pieces as sentencepiece does on load (no empty or repeated piece, exactly
  // one UNKNOWN, byte pieces only with byte_fallback and then all 256); fails naming
  // `file`.
  SentencePieceVocab(const SentencePieceModelProto& model, const std::string& file);

  int32_t size() const { return static_cast<int32_t>(pieces_.size()); }
  const std::string& piece(int32_t id) const { return pieces_[id].piece; }
  float score(int32_t id) const { return pieces_[id].score; }
  SentencePieceType type(int32_t id) const { return pieces_[id].type; }

  // The text piece spelled `piece`, if any.
  std::optional<int32_t> find_text_piece(std::string_view piece) const;
  // sentencepiece's PieceToId.
  int32_t piece_to_id(std::string_view piece) const;
  int32_t unk_id() const { return unk_id_; }
  // The byte a BYTE piece stands for.
  uint8_t byte_value(int32_t id) const { return byte_values_[id]; }
  const std::vector<std::string>& user_defined_symbols() const { return user_defined_symbols_; }

  // Appends the ids of `surface`, a piece of the normalized text that the model
  // recognized as `id`, after `ids` (NOTE [Unknown pieces]).
  void append_piece(std::string_view surface, int32_t id, std::vector<int32_t>& ids) const;
  // After ids[0, seam) were followed by ids that append_piece made for a later stretch of
  // the same text (computed apart, or cached): drops ids[seam] when it continues an <unk>
  // run (NOTE [Unknown pieces]).
  void join_unknown_run(std::vector<int32_t>& ids, size_t seam) const;

 private:
  std::vector<SentencePiece> pieces_;
  TokenIdMap text_pieces_;      // NORMAL, USER_DEFINED, UNUSED
  TokenIdMap reserved_pieces_;  // CONTROL, UNKNOWN, BYTE
  std::vector<std::string> user_defined_symbols_;
  int32_t unk_id_ = -1;
  bool byte_fallback_ = false;
  std::array<int32_t, 256> byte_ids_{};  // the id of <0xNN>, with byte_fallback
  std::vector<uint8_t> byte_values_;     // per id; meaningful for BYTE pieces
};

}  // namespace forge
