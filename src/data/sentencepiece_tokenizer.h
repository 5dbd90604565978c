// A SentencePiece tokenizer.model (Llama 2, Mistral and others ship one), run by the
// SentencePiece library itself (libsentencepiece), so ids equal those of the sentencepiece
// Python package on the same model: normalization, BPE or unigram, byte fallback and all.
// Text written as "<s>" is plain text here, as in SentencePiece.
#pragma once

#include <memory>
#include <string>

#include "data/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace forge {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Fails naming `file` when it is not a SentencePiece model.
  explicit SentencePieceTokenizer(const std::string& file);
  ~SentencePieceTokenizer() override;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override;
  std::optional<int32_t> bos_id() const override;
  std::optional<int32_t> eos_id() const override;

 private:
  std::string file_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
};

}  // namespace forge
