#include "data/sentencepiece_vocab.h"

#include <fmt/format.h>

#include "core/error.h"

namespace forge {
namespace {

// The byte "<0xNN>" spells (two upper-case hex digits, as sentencepiece writes them), or -1.
int byte_of_piece(std::string_view piece) {
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; };
  if (piece.size() != 6 || !piece.starts_with("<0x") || piece[5] != '>') return -1;
  const int high = hex(piece[3]), low = hex(piece[4]);
  return high < 0 || low < 0 ? -1 : high * 16 + low;
}

}  // namespace

bool is_text_piece(SentencePieceType type) {
  return type == SentencePieceType::Normal || type == SentencePieceType::UserDefined ||
         type == SentencePieceType::Unused;
}

SentencePieceVocab::SentencePieceVocab(const SentencePieceModelProto& model, const std::string& file)
    : pieces_(model.pieces), byte_fallback_(model.trainer_spec.byte_fallback) {
  byte_ids_.fill(-1);
  byte_values_.assign(pieces_.size(), 0);
  text_pieces_.reserve(pieces_.size());
  for (int32_t id = 0; id < size(); ++id) {
    const SentencePiece& piece = pieces_[id];
    auto fail = [&](std::string_view problem) {
      FORGE_FAIL("{}: not a valid SentencePiece model: pieces[{}] '{}': {}", file, id, piece.piece, problem);
    };
    if (piece.piece.empty()) fail("the piece is empty");
    auto& map = is_text_piece(piece.type) ? text_pieces_ : reserved_pieces_;
    if (!map.emplace(piece.piece, id).second)
      fail(fmt::format("the piece is already defined (pieces[{}])", map.find(piece.piece)->second));
    switch (piece.type) {
      case SentencePieceType::UserDefined:
        user_defined_symbols_.push_back(piece.piece);
        break;
      case SentencePieceType::Unknown:
        if (unk_id_ >= 0) fail(fmt::format("a second UNKNOWN piece (pieces[{}] is one)", unk_id_));
        unk_id_ = id;
        break;
      case SentencePieceType::Byte: {
        if (!byte_fallback_) fail("a BYTE piece, but trainer_spec.byte_fallback is false");
        const int byte = byte_of_piece(piece.piece);
        if (byte < 0) fail("a BYTE piece must be <0x00> to <0xFF>");
        byte_ids_[byte] = id;
        byte_values_[id] = static_cast<uint8_t>(byte);
        break;
      }
      default:
        break;
    }
  }
  if (unk_id_ < 0) FORGE_FAIL("{}: not a valid SentencePiece model: no piece has type UNKNOWN", file);
  if (byte_fallback_) {
    int missing = 0;
    for (int32_t id : byte_ids_) missing += id < 0;
    if (missing)
      FORGE_FAIL("{}: not a valid SentencePiece model: trainer_spec.byte_fallback is true but {} of the 256 byte "
                 "pieces <0x00>..<0xFF> are missing",
                 file, missing);
  }
}

std::optional<int32_t> SentencePieceVocab::find_text_piece(std::string_view piece) const {
  auto it = text_pieces_.find(piece);
  if (it == text_pieces_.end()) return std::nullopt;
  return it->second;
}

int32_t SentencePieceVocab::piece_to_id(std::string_view piece) const {
  if (auto it = reserved_pieces_.find(piece); it != reserved_pieces_.end()) return it->second;
  if (auto it = text_pieces_.find(piece); it != text_pieces_.end()) return it->second;
  return unk_id_;
}

void SentencePieceVocab::append_piece(std::string_view surface, int32_t id, std::vector<int32_t>& ids) const {
  if (id != unk_id_) {
    ids.push_back(id);
  } else if (byte_fallback_) {
    for (char byte : surface) ids.push_back(byte_ids_[static_cast<uint8_t>(byte)]);
  } else if (ids.empty() || ids.back() != unk_id_) {
    ids.push_back(unk_id_);
  }
}

void SentencePieceVocab::join_unknown_run(std::vector<int32_t>& ids, size_t seam) const {
  if (!byte_fallback_ && seam > 0 && seam < ids.size() && ids[seam - 1] == unk_id_ && ids[seam] == unk_id_)
    ids.erase(ids.begin() + static_cast<ptrdiff_t>(seam));
}

}  // namespace forge
