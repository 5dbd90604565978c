// CLIP's tokenizer as FLUX.1 runs it (its tokenizer/ folder, transformers' CLIPTokenizer),
// for the captions the CLIP text encoder reads (model/clip_text_encoder.h).
//
// NOTE [CLIP tokenizer]
// transformers 5 (the version the tests compare with) has one CLIPTokenizer, backed by Hugging
// Face tokenizers; there is no slow Python path any more, and so no ftfy or BasicTokenizer
// clean-up either, whatever is installed: FluxPipeline gets this pipeline, and so does forge.
// The pipeline is fixed by the class, whatever a tokenizer.json beside the files says:
//   normalizer      NFC, every run of whitespace (\s+) to one space, Lowercase
//   pre-tokenizer   Split on <\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|
//                   [\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+ keeping the matches only (the spaces
//                   between them are dropped), then ByteLevel (GPT-2's bytes-to-characters
//                   map, after GPT-2's split regex) without a prefix space
//   model           BPE with the end-of-word suffix "</w>" on each word's last character
//                   (NOTE [End-of-word suffix] in bpe_model.h), unknown characters to unk
//   specials        bos, text, eos (RobertaProcessing); FluxPipeline pads with pad to
//                   max_length 77 and truncates the text to 75 tokens, keeping eos
// forge builds that pipeline as a tokenizer.json in memory and runs it through HfTokenizer,
// with
//   vocab, merges   tokenizer.json's model.vocab and model.merges when there is a
//                   tokenizer.json, else vocab.json and merges.txt (a "#version" line is
//                   skipped; every other line is "left right"), as transformers reads them
//   special tokens  bos_token, eos_token, unk_token, pad_token (CLIPTokenizer's defaults
//                   <|startoftext|>, <|endoftext|>, <|endoftext|>, <|endoftext|>) and their
//                   flags (lstrip, rstrip, single_word, normalized), resolved as transformers
//                   5 does: tokenizer_config.json's added_tokens_decoder when it has one (then
//                   special_tokens_map.json is not read); otherwise tokenizer_config.json's
//                   values overridden by special_tokens_map.json's, with tokenizer.json's
//                   added_tokens as the decoder. A named token whose text the decoder lacks is
//                   added after it (a plain string: special, not normalized; a later one with
//                   the same text replaces an earlier one's flags).
// Every special token must be in the vocab (CLIP's are: 49406 and 49407), with the id the
// decoder gives it; additional special tokens, added_tokens.json, and left padding or
// truncation are refused naming the file and the key.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/hf_tokenizer.h"

namespace forge {

class ClipTokenizer {
 public:
  // `path`: a CLIP tokenizer folder (FLUX.1's tokenizer/) or a folder holding one as
  // tokenizer/. Fails naming the file and what is wrong.
  explicit ClipTokenizer(const std::string& path);

  // The ids of `text` without bos and eos: tokenizers' encode(text, add_special_tokens=False).
  std::vector<int32_t> encode(std::string_view text) const;
  // What FluxPipeline feeds CLIP: bos, the text's first `length` - 2 ids, eos, then pad up to
  // `length` (>= 2) ids.
  std::vector<int32_t> encode_padded(std::string_view text, int64_t length) const;
  // encode_padded of each text, spread over the thread pool, one row after another.
  std::vector<int32_t> encode_padded_batch(const std::vector<std::string>& texts, int64_t length) const;

  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  int32_t pad_id() const { return pad_id_; }
  int64_t vocab_size() const { return tokenizer_->vocab_size(); }
  const std::string& folder() const { return folder_; }

 private:
  std::string folder_;
  std::unique_ptr<HfTokenizer> tokenizer_;
  int32_t bos_id_ = 0, eos_id_ = 0, pad_id_ = 0;
};

}  // namespace forge
