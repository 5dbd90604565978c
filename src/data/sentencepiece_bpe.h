// BPE as SentencePiece encodes it (model_type BPE: Llama 2, Mistral, Gemma and many
// others ship one), token for token equal to sentencepiece's bpe::Model::Encode.
//
// What sentencepiece does. The normalized text (one sentence: sentencepiece does not
// split it into words when encoding) starts as one symbol per UTF-8 character, except
// that a user-defined symbol starting at a character is taken whole and frozen: it never
// merges. Every pair of adjacent unfrozen symbols whose concatenation is a text piece
// (NORMAL, USER_DEFINED or UNUSED; NOTE in sentencepiece_vocab.h) is a candidate, ranked
// by that piece's score: the highest score merges first and, among equal scores, the
// leftmost pair. A merge replaces the two symbols with their concatenation and makes
// candidates of the new symbol's pairs with its neighbours; it stops when no candidate
// is left. There is no merge list: a model's BPE merges are implied by its pieces'
// scores, which is why this differs from Hugging Face's rank-ordered BPE (bpe_model.h).
// Each final symbol is then looked up (sentencepiece's PieceToId, which gives a
// character no piece spells the unknown id), and an UNUSED piece is split again into
// the two symbols that formed it (sentencepiece remembers, per encode, the last pair it
// queued for each UNUSED piece).
//
// How forge matches it, faster.
// - Symbols are ids, not strings: a text piece is its own id, a character that is not a
//   text piece but occurs in one gets a synthetic id after the vocab, and a character
//   that occurs in no text piece can never merge. At load, every way of cutting every
//   text piece in two whose halves are both symbols gives the merge table
//   (left symbol, right symbol) -> (piece, score), so a candidate is one hash lookup.
// - The queue holds (score, left position, the pair's two symbols, merged piece); a
//   popped candidate is stale when the left position or its right neighbour no longer
//   holds the symbol it was queued with (symbols only grow, so equal symbols mean the
//   same pair).
//
// NOTE [SentencePiece BPE words]
// sentencepiece runs one merge queue over the whole text; forge cuts the text into words
// and caches each word's ids (NOTE [BPE word cache]). Cutting is exact wherever no merge
// can cross the cut: a merge across the boundary between characters a and b would form
// a text piece containing "ab", so forge cuts between a and b when no text piece
// contains that pair, checked where it matters (next to the whitespace symbol "▁", or
// " " when the model does not escape whitespace), and around characters no piece
// contains and around user-defined symbols, which never merge. Merges in different words
// are independent, so the global order of equal scores does not matter across a cut.
// With Llama 2's vocab the words are "▁word", runs of "▁" stay with the word after them
// (its "▁▁" pieces join them), and treat_whitespace_as_suffix models cut after "▁".
// A model with UNUSED pieces is encoded whole, uncached: the pair remembered for an
// UNUSED piece may come from anywhere in the text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/byte_trie.h"
#include "data/sentencepiece_model.h"
#include "data/sentencepiece_vocab.h"
#include "data/token_cache.h"

namespace forge {

class SentencePieceBpe final : public SentencePieceModel {
 public:
  // `vocab` and `user_defined_symbols` must outlive the model. `whitespace` is the
  // character the normalizer writes for a space ("▁" or " ").
  SentencePieceBpe(const SentencePieceVocab& vocab, const ByteTrie& user_defined_symbols, std::string_view whitespace);

  void encode(std::string_view normalized, std::vector<int32_t>& ids) const override;

 private:
  struct Merge {
    int32_t piece;
    float score;
  };
  struct Symbols;  // one text's symbols while they merge (sentencepiece_bpe.cpp)

  static constexpr int32_t kInert = -1;  // a symbol that never merges
  // Flags of a character some text piece joins to the whitespace character.
  static constexpr uint8_t kJoinedBeforeWhitespace = 1;  // "a▁"
  static constexpr uint8_t kJoinedAfterWhitespace = 2;   // "▁a"

  int32_t symbol_of(int32_t code_point) const;
  const Merge* find_merge(int32_t left, int32_t right) const;
  uint8_t whitespace_joins(int32_t code_point) const;
  bool cut_between(int32_t left_code_point, int32_t left_symbol, int32_t right_code_point, int32_t right_symbol) const;
  std::string_view symbol_text(int32_t symbol) const;

  void add_character_symbols(const std::vector<int32_t>& code_points);
  void add_merges();
  void encode_word(std::string_view word, std::vector<int32_t>& ids) const;
  void encode_whole(std::string_view text, std::vector<int32_t>& ids) const;
  void merge(Symbols& symbols, std::unordered_map<int32_t, std::pair<int32_t, int32_t>>* unused_pairs) const;
  void append_symbol(int32_t symbol, std::string_view surface,
                     const std::unordered_map<int32_t, std::pair<int32_t, int32_t>>* unused_pairs,
                     std::vector<int32_t>& ids) const;

  const SentencePieceVocab& vocab_;
  const ByteTrie& user_defined_symbols_;
  int32_t whitespace_code_point_;
  bool has_unused_pieces_ = false;

  std::vector<int32_t> bmp_symbols_;  // symbol of each code point below U+10000, kInert where none
  std::unordered_map<int32_t, int32_t> astral_symbols_;
  std::vector<std::string> synthetic_symbol_texts_;  // the character of symbol vocab.size() + i
  std::vector<int32_t> output_ids_;                  // PieceToId of each symbol's text
  std::unordered_map<uint64_t, Merge> merges_;
  std::vector<uint8_t> bmp_whitespace_joins_;  // kJoined* flags of each code point below U+10000
  std::unordered_map<int32_t, uint8_t> astral_whitespace_joins_;
  mutable TokenCache cache_;
};

}  // namespace forge
