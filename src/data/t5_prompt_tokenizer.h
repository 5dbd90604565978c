// The T5 token ids FLUX.1 encodes a caption with: FluxPipeline's tokenizer_2
// (transformers' T5TokenizerFast, 5.x's T5Tokenizer) called with
// padding="max_length", max_length=512, truncation=True.
//
// NOTE [T5 prompt tokens]
// transformers builds T5's tokenizer the same way whether it reads spiece.model
// or tokenizer.json (in 5.x the class defines the pipeline; a file gives the
// vocabulary, the charsmap and the added tokens), and forge runs that pipeline:
//   1. added tokens (<pad>, </s>, <unk>, the 100 sentinels <extra_id_N>, a
//   model's other
//      control and user-defined pieces) are cut out of the raw text first,
//      leftmost-longest, each one id; the text between them is tokenized piece
//      by piece;
//   2. normalizer: the SentencePiece model's precompiled charsmap (nmt_nfkc for
//   T5);
//   3. pre-tokenizer: WhitespaceSplit (Unicode White_Space separates words and
//   is dropped),
//      then Metaspace: each word gets a leading "▁" (unless it has one) and is
//      split before every further "▁";
//   4. model: tokenizers' Unigram on each word alone: Viterbi over the pieces
//   of the whole
//      vocabulary (control pieces and sentinels included), scores summed in
//      double, the first best offer kept at each position, a character no piece
//      starts scoring the lowest score - 10 as <unk>, and runs of <unk> in a
//      word fused into one;
//   5. post-processing and shape: truncated to max_length - 1 ids, </s> (id 1)
//   appended,
//      padded with <pad> (id 0) to max_length.
// This differs from sentencepiece's own encoding
// (data/sentencepiece_tokenizer.h) in steps 1, 3 and 4: added tokens,
// whitespace handling and per-word (not whole-text, float) Viterbi.
//
// One known departure from tokenizers: its Precompiled normalizer looks
// graphemes up (a cluster of under 6 bytes whole, where the first match of the
// cluster's prefixes replaces all of it, else character by character), while
// forge applies the longest charsmap rule at each position, as sentencepiece
// does. The two agree wherever every grapheme is one character or a rule covers
// the whole cluster (precomposed or combining accents, full-width forms,
// ligatures, every script a caption set is likely to hold); they can differ for
// a cluster whose first character has a rule of its own and is followed by
// marks the rule does not cover (a full-width letter with a combining accent,
// half-width katakana with a voiced mark, conjoining Hangul jamo).
//
// The vocabulary must have T5's layout (<pad>, </s>, <unk> as ids 0, 1, 2; a
// unigram model); any other is refused naming the file. Text must be valid
// UTF-8 (an error names the byte offset).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/added_tokens.h"
#include "data/byte_trie.h"
#include "data/precompiled_charsmap.h"
#include "data/string_map.h"

namespace forge {

class T5PromptTokenizer {
 public:
  static constexpr int32_t kPadId = 0, kEosId = 1, kUnkId = 2;
  static constexpr int64_t kFluxMaxLength = 512;  // FluxPipeline's max_sequence_length

  // `path`: spiece.model, tokenizer.json, or a folder holding one
  // (tokenizer.json first, as transformers prefers it), or a FLUX pipeline
  // folder holding one as tokenizer_2/. With spiece.model, the sentinel count
  // is tokenizer_config.json's extra_ids when that file is beside it, else 100.
  explicit T5PromptTokenizer(const std::string& path);
  ~T5PromptTokenizer();

  // The ids of `text` without </s>: steps 1-4 of NOTE [T5 prompt tokens].
  std::vector<int32_t> encode(std::string_view text) const;
  // FluxPipeline's input_ids for one caption: max_length ids (step 5).
  std::vector<int32_t> prompt_ids(std::string_view caption, int64_t max_length = kFluxMaxLength) const;

  const std::string& file() const { return file_; }
  int64_t vocab_size() const { return static_cast<int64_t>(pieces_.size()); }

 private:
  void read_sentencepiece(const std::string& file, int64_t extra_ids);
  void read_tokenizer_json(const std::string& file);
  void finish(std::vector<AddedToken> added);
  void encode_text(std::string_view text, std::vector<int32_t>& ids) const;
  void encode_word(std::string_view word, std::vector<int32_t>& ids) const;

  std::string file_;
  std::vector<std::string> pieces_;
  std::vector<double> scores_;
  TokenIdMap ids_;  // a piece's id (the last of equal pieces, as tokenizers keeps)
  ByteTrie trie_;
  double unknown_score_ = 0.0;
  std::optional<PrecompiledCharsmap> charsmap_;
  std::unique_ptr<AddedTokenMatcher> added_;
};

}  // namespace forge
