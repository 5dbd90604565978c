// The BPE model of a Hugging Face tokenizer.json: vocab, ranked merges, and the options
// Llama-family tokenizers use (byte_fallback, unk_token, fuse_unk, ignore_merges) and CLIP's
// end_of_word_suffix.
//
// NOTE [BPE merge order]
// A word starts as one symbol per character (or per byte token with byte_fallback). The
// merge with the lowest rank among all adjacent pairs is applied first, the leftmost one
// among equal ranks, until no adjacent pair has a merge. A min-heap of (rank, position)
// with stale entries skipped gives exactly that order in O(n log n), as in Hugging Face's
// Word::merge_all. With ignore_merges a word that is itself in the vocab is one token.
// Words are cached, as token_cache.h's NOTE [BPE word cache] describes.
//
// NOTE [End-of-word suffix]
// A model with an end_of_word_suffix (CLIP's "</w>") marks the last character of every word:
// its initial symbol is the vocab's token for the character followed by the suffix ("o</w>"),
// unknown (unk, or its bytes and the suffix's with byte_fallback) when the vocab lacks it,
// as in Hugging Face's BPE::merge_word; the merges then build "</w>" tokens from it.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/string_map.h"
#include "data/token_cache.h"
#include "data/tokenizer_json_reader.h"

namespace forge {

// A merge given as data: the ids of the adjacent pair and of the token it becomes.
struct BpeMerge {
  int32_t left, right, merged;
};

class BpeModel {
 public:
  // Reads tokenizer.json's "model" object (type BPE); fails naming the file and the field.
  BpeModel(const nlohmann::json& model, const TokenizerJsonReader& reader);
  // A BPE given as data (a tiktoken file's, tiktoken_tokenizer.h): `vocab` maps token
  // strings to ids, `merges` are in rank order; no unk token, no byte fallback.
  BpeModel(TokenIdMap vocab, const std::vector<BpeMerge>& merges, bool ignore_merges);

  // Appends the ids of one pre-tokenized word to `out`.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_id(std::string_view token) const;
  const TokenIdMap& vocab() const { return vocab_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  void index_characters();
  void read_merges(const nlohmann::json& merges, const TokenizerJsonReader& reader);
  std::vector<int32_t> initial_symbols(std::string_view word) const;
  std::optional<int32_t> character_id(std::string_view character) const;
  void merge(std::vector<int32_t>& symbols) const;
  const Merge* find_merge(int32_t left, int32_t right) const;

  TokenIdMap vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string end_of_word_suffix_;  // NOTE [End-of-word suffix]; empty: none
  std::array<int32_t, 256> byte_token_ids_{};  // "<0xNN>" ids, -1 where absent
  std::vector<int32_t> bmp_character_ids_;      // id of each single-character token below U+10000, -1 where absent
  mutable TokenCache cache_;
};

}  // namespace forge
