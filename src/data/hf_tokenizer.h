// A Hugging Face tokenizer.json with a BPE model, run as Hugging Face's pipeline does:
//   added tokens (in the original text) → normalizer → added tokens (normalized ones, in
//   normalized text) → pre-tokenizer → BPE per word;  ids → token strings → decoder.
// This covers byte-level BPE as in Llama 3 (Split regex + ByteLevel, ignore_merges) and
// SentencePiece-style BPE as in Llama 2 / Mistral (Prepend/Replace normalizer or Metaspace,
// byte_fallback). Unsupported components fail at load time naming the file and the type.
//
// BOS / EOS: the special tokens around $A in the TemplateProcessing post-processor, else
// bos_token / eos_token of a tokenizer_config.json next to the file, else the added token
// among the usual names (<|begin_of_text|>, <s>; <|end_of_text|>, </s>, <|endoftext|>).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/added_tokens.h"
#include "data/bpe_model.h"
#include "data/tokenizer.h"
#include "data/tokenizer_decoder.h"
#include "data/tokenizer_normalizer.h"
#include "data/tokenizer_pre_tokenizer.h"

namespace forge {

class HfTokenizer final : public Tokenizer {
 public:
  // `config` is the parsed content of `file`.
  HfTokenizer(const nlohmann::json& config, const std::string& file);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  std::optional<int32_t> bos_id() const override { return bos_id_; }
  std::optional<int32_t> eos_id() const override { return eos_id_; }

 private:
  void read_added_tokens(const nlohmann::json& config, const TokenizerJsonReader& reader);
  void find_bos_eos(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& file);
  std::optional<int32_t> token_id(std::string_view token) const;
  void encode_normalized(std::string text, bool at_text_start, std::vector<int32_t>& ids) const;

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<AddedToken> added_tokens_;
  std::unique_ptr<AddedTokenMatcher> original_text_tokens_, normalized_text_tokens_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> id_known_;
  std::optional<int32_t> bos_id_, eos_id_;
};

}  // namespace forge
