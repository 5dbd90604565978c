// Meta's Llama 3 tokenizer read from its tiktoken BPE file: the tokenizer.model of the
// original/ folder of Llama 3, 3.1, 3.2 and 3.3 checkpoints (torchtitan reads it), run
// natively as the tokenizer.json Hugging Face converts from it:
//   special tokens matched in the text → Llama 3 split regex → byte-level BPE by rank.
//
// NOTE [tiktoken as tokenizer.json]
// Hugging Face converts the file with transformers' TikTokenConverter
// (src/transformers/convert_slow_tokenizer.py): the ranks become the vocab (token bytes
// as GPT-2 byte characters); every token of two or more bytes gets a merge for each cut
// into two tokens, merges ordered by the token's rank, then by the ranks of the left and
// right parts; ignore_merges; the pre-tokenizer is Split(Llama 3 pattern, Isolated) +
// ByteLevel(no prefix space, no regex); Meta's special tokens are added tokens (special,
// not normalized), which tokenizers matches in any text. forge builds exactly that in
// memory and runs it on the engine tokenizer.json files use (AddedTokenMatcher,
// PreTokenizer, BpeModel), so its ids are the converted tokenizer.json's. It is also
// tiktoken's algorithm (merge the adjacent pair whose concatenation has the lowest rank,
// leftmost first; a piece that is a token is that token), but for one detail: tiktoken
// gives every cut of a token the token's rank, the converted merges order the cuts by
// their parts. That could only matter where two cuts of one token overlap in a word;
// tests/python/test_tiktoken_vs_hf.py compares forge with both and finds no difference.
//
// Where Meta's own tokenizer.py differs from the tokenizer.json, forge follows the
// tokenizer.json: Meta's encode() reads special-token text such as "<|eot_id|>" as plain
// text by default (disallowed_special=()), and cuts texts into 400,000-character chunks
// and runs of more than 25,000 whitespace or non-whitespace characters.
//
// The pattern (Meta's pat_str, the same in meta-llama/llama3 llama/tokenizer.py and
// meta-llama/llama-models models/llama3/tokenizer.py, and TikTokenConverter's default):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//
// NOTE [Llama 3 special tokens]
// The file holds only the ranks; Meta's tokenizer.py adds 256 special tokens numbered
// from the number of ranks (128000 for Llama 3): BOS <|begin_of_text|> (first) and EOS
// <|end_of_text|> (second), as Meta's bos_id / eos_id. Their names changed between
// releases while the file stayed the same:
//   Llama 3 (meta-llama/llama3 llama/tokenizer.py; torchtitan's TikTokenizer; Hugging
//     Face's Llama 3 tokenizer.json): begin_of_text, end_of_text, reserved_special_token
//     0-3, start_header_id, end_header_id, reserved_special_token_4, eot_id, then
//     reserved_special_token_5..250.
//   Llama 3.1 and later as Hugging Face's tokenizer.json holds them (transformers'
//     convert_llama_weights_to_hf.py, DEFAULT_LLAMA_SPECIAL_TOKENS["3.1"]): begin_of_text,
//     end_of_text, reserved_special_token_0, _1, finetune_right_pad_id,
//     reserved_special_token_2, start_header_id, end_header_id, eom_id, eot_id,
//     python_tag, then reserved_special_token_3..247. (Meta's llama-models names the
//     sixth <|step_id|> and, from 3.2, the twelfth <|image|>; the tokenizer.json does not.)
// The ids of BOS, EOS, the header tokens and <|eot_id|> are the same in both. forge
// takes the Llama 3.1 names when a params.json beside the file (Meta ships one in the same
// folder) sets "use_scaled_rope": true, which every Llama 3.1, 3.2 and 3.3 model does and
// no Llama 3 model does (llama-models' sku_list.py); otherwise the Llama 3 names.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/added_tokens.h"
#include "data/bpe_model.h"
#include "data/tokenizer.h"
#include "data/tokenizer_pre_tokenizer.h"

namespace forge {

class TiktokenTokenizer final : public Tokenizer {
 public:
  // Reads the tiktoken BPE `file`; fails naming file:line (tiktoken_bpe_file.h).
  explicit TiktokenTokenizer(const std::string& file);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(token_bytes_.size()); }
  std::optional<int32_t> bos_id() const override { return bos_id_; }
  std::optional<int32_t> eos_id() const override { return eos_id_; }

 private:
  std::vector<std::string> token_bytes_;  // by id: the ranks' bytes, then the special tokens' text
  std::unique_ptr<AddedTokenMatcher> special_tokens_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  int32_t bos_id_ = 0, eos_id_ = 0;
};

}  // namespace forge
