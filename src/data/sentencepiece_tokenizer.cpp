#include "data/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include "core/error.h"

namespace forge {

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& file)
    : file_(file), processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  const auto status = processor_->Load(file);
  if (!status.ok()) FORGE_FAIL("{}: not a valid SentencePiece model: {}", file, status.ToString());
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  if (!status.ok()) FORGE_FAIL("{}: SentencePiece could not encode the text: {}", file_, status.ToString());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string SentencePieceTokenizer::decode(const std::vector<int32_t>& ids) const {
  for (int32_t id : ids)
    if (id < 0 || id >= vocab_size()) FORGE_FAIL("decode: token id {} is not in the vocab (size {})", id, vocab_size());
  std::string text;
  const auto status = processor_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  if (!status.ok()) FORGE_FAIL("{}: SentencePiece could not decode the ids: {}", file_, status.ToString());
  return text;
}

int64_t SentencePieceTokenizer::vocab_size() const { return processor_->GetPieceSize(); }

std::optional<int32_t> SentencePieceTokenizer::bos_id() const {
  const int id = processor_->bos_id();
  return id >= 0 ? std::optional<int32_t>(id) : std::nullopt;
}

std::optional<int32_t> SentencePieceTokenizer::eos_id() const {
  const int id = processor_->eos_id();
  return id >= 0 ? std::optional<int32_t>(id) : std::nullopt;
}

}  // namespace forge
