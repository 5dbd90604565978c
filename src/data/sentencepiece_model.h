// The segmentation half of a SentencePiece model: normalized text in, ids out. BPE
// (sentencepiece_bpe.h) and unigram (sentencepiece_unigram.h) implement it; the tokenizer
// (sentencepiece_tokenizer.h) normalizes before and decodes after.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

namespace forge {

// The length of the character at text[pos] as sentencepiece's models step through text:
// what its first byte announces, clipped to the text, without validating the rest (the
// normalizer's output is valid UTF-8).
inline size_t sentencepiece_character_length(std::string_view text, size_t pos) {
  const auto lead = static_cast<uint8_t>(text[pos]);
  const size_t length = lead < 0xC0 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
  return std::min(length, text.size() - pos);
}

class SentencePieceModel {
 public:
  virtual ~SentencePieceModel() = default;
  // Appends the ids of `normalized`, the normalizer's output, to `ids`, unknown pieces
  // already turned into <unk> or byte ids (NOTE [Unknown pieces]).
  virtual void encode(std::string_view normalized, std::vector<int32_t>& ids) const = 0;
};

}  // namespace forge
