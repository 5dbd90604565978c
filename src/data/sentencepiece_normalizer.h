// SentencePiece's normalizer: the text a model's BPE or unigram sees, made from the
// input as sentencepiece's Normalizer::Normalize makes it. Also runs a model's
// denormalizer_spec on decoded text.
//
// NOTE [SentencePiece normalization]
// The input is consumed from the left, one prefix at a time:
//   1. a user-defined symbol that starts here (the longest one) is copied unchanged:
//      user-defined symbols escape normalization;
//   2. else the longest precompiled charsmap rule that starts here gives its replacement
//      (NOTE [Precompiled charsmap]; "identity" models have no rules);
//   3. else one UTF-8 character is copied, and a byte that does not start a valid
//      character becomes U+FFFD (so invalid UTF-8 reaches the model as U+FFFD, and
//      decode gives U+FFFD back: sentencepiece cannot round-trip invalid bytes, and
//      forge, matching its ids, cannot either).
// Around that, with the spec's flags:
//   remove_extra_whitespaces  prefixes that normalize to " " are dropped at the start,
//                             leading spaces of a prefix's replacement are dropped after
//                             a replacement that ended in a space, and trailing spaces
//                             are dropped at the end;
//   add_dummy_prefix          one space is put before the text (after it instead with
//                             treat_whitespace_as_suffix), unless the input is empty or
//                             all of it was dropped as whitespace;
//   escape_whitespaces        every " " in the output is written as U+2581 "▁".
// Only U+0020 is a space here; tabs, newlines and other white space are spaces only
// where the charsmap maps them to " " (nmt_nfkc does, identity does not).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "data/byte_trie.h"
#include "data/precompiled_charsmap.h"
#include "data/sentencepiece_model_proto.h"

namespace forge {

class SentencePieceNormalizer {
 public:
  // `user_defined_symbols` (may be empty) must outlive the normalizer. Fails naming
  // `where` when the charsmap is malformed.
  SentencePieceNormalizer(const SentencePieceNormalizerSpec& spec, bool treat_whitespace_as_suffix,
                          const ByteTrie& user_defined_symbols, const std::string& where);

  // Replaces `out` with the normalized `input`.
  void normalize(std::string_view input, std::string& out) const;

 private:
  // The normalized form of the prefix of `input` (steps 1-3 of the NOTE) and how many
  // bytes of `input` it consumes.
  std::pair<std::string_view, size_t> normalize_prefix(std::string_view input) const;
  void append_space(std::string& out) const;

  std::optional<PrecompiledCharsmap> charsmap_;
  const ByteTrie& user_defined_symbols_;
  std::array<bool, 256> plain_bytes_{};  // ASCII bytes that no rule or symbol starts with: copied as they are
  bool add_dummy_prefix_;
  bool remove_extra_whitespaces_;
  bool escape_whitespaces_;
  bool treat_whitespace_as_suffix_;
};

}  // namespace forge
