// Tokenizers turn text into token ids and back. forge reads the files models ship with:
// Hugging Face tokenizer.json (byte-level BPE as in Llama 3, or SentencePiece-style BPE
// with byte fallback as in Llama 2 and Mistral), SentencePiece tokenizer.model files and
// the tiktoken tokenizer.model of Meta's Llama 3 checkpoints.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text`, without BOS/EOS (special tokens written in the text are
  // recognized as the tokenizer file says). Must equal Hugging Face tokenizers'
  // encode(text, add_special_tokens=False).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // encode() of each text, the texts spread over the thread pool (core/parallel.h).
  // Results are identical to encoding the texts one by one.
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string_view>& texts) const;
  // Text of `ids` (special tokens included verbatim).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;  // including added tokens
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
};

// Loads tokenizer.json or tokenizer.model (SentencePiece or tiktoken, told apart by
// content), or a directory holding one of them. Fails naming the file and what is wrong.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

}  // namespace forge
