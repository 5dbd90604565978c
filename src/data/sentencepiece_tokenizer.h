// A SentencePiece tokenizer.model (Llama 2, Mistral, Gemma, T5 and others ship one), run
// by forge itself: ids and decoded text equal those of the sentencepiece package (0.2.3)
// on the same model. forge reads the ModelProto with its own wire reader
// (sentencepiece_model_proto.h) and encodes as sentencepiece's SentencePieceProcessor:
//   normalize (sentencepiece_normalizer.h) → BPE (sentencepiece_bpe.h) or unigram
//   (sentencepiece_unigram.h) → unknown pieces to <unk> or bytes (sentencepiece_vocab.h).
// Model types WORD and CHAR are rejected at load naming the file. Text written as "<s>"
// is plain text here, as in sentencepiece: control pieces never come from text.
//
// NOTE [SentencePiece decode]
// As sentencepiece's Decode: control pieces decode to nothing and <unk> to
// trainer_spec.unk_surface (" ⁇ " by default); a run of byte pieces decodes to its bytes,
// each byte that does not belong to a valid UTF-8 character becoming U+FFFD; "▁" becomes
// " " in every other piece. Until some text has come out (or a leading "▁" has been
// dropped), a piece's leading "▁" is dropped when the model adds a dummy prefix or removes
// extra whitespace, and with remove_extra_whitespaces it keeps being dropped from the
// pieces that follow while they decode to nothing. A denormalizer_spec with rules, if
// the model has one, then runs over the text.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/byte_trie.h"
#include "data/sentencepiece_model.h"
#include "data/sentencepiece_normalizer.h"
#include "data/sentencepiece_vocab.h"
#include "data/tokenizer.h"

namespace forge {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Fails naming `file` when it is not a SentencePiece model forge can encode with.
  explicit SentencePieceTokenizer(const std::string& file);
  ~SentencePieceTokenizer() override;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return vocab_->size(); }
  std::optional<int32_t> bos_id() const override { return bos_id_; }
  std::optional<int32_t> eos_id() const override { return eos_id_; }

 private:
  std::optional<int32_t> control_id(const std::string& piece) const;
  void append_bytes(const std::string& bytes, std::string& text) const;

  std::unique_ptr<SentencePieceVocab> vocab_;
  ByteTrie user_defined_symbols_;
  ByteTrie no_symbols_;  // the denormalizer's: decoded text has no user-defined symbols to protect
  std::unique_ptr<SentencePieceNormalizer> normalizer_, denormalizer_;
  std::unique_ptr<SentencePieceModel> model_;
  std::vector<int32_t> decode_ids_;  // PieceToId of each id's piece, as decode looks pieces up
  std::string unknown_surface_;
  bool drop_leading_whitespace_ = false;  // add_dummy_prefix or remove_extra_whitespaces
  bool drop_all_leading_whitespace_ = false;  // remove_extra_whitespaces
  std::optional<int32_t> bos_id_, eos_id_;
};

}  // namespace forge
