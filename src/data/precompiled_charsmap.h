// SentencePiece's normalization rules as a model carries them: NormalizerSpec's
// precompiled_charsmap, compiled by sentencepiece from NFKC and its variants (nmt_nfkc,
// nfkc_cf, nmt_nfkc_cf) or from a user's rule TSV. Any rule set works: forge reads the
// compiled form, not the rule names.
//
// NOTE [Precompiled charsmap]
// The blob is a little-endian uint32 byte size of a darts-clone double-array trie, the
// trie's 32-bit units, then the replacement strings, each ending in a NUL byte. The trie's
// keys are the byte strings a rule replaces; a key's value is the offset of its
// replacement. At each position of the text sentencepiece takes the longest key that is
// a prefix of the rest of the text (among the first 32 matches, its builder guarantees
// no more) and emits its replacement.
//
// A darts-clone unit packs, in 32 bits: a label (the byte that leads to it, bits 0-7, or
// bit 31 set in a leaf unit, which then holds a 31-bit value), a has-leaf flag (bit 8)
// and an offset to its children (bits 10-31, shifted left by 8 when bit 9 is set). From
// node position p, byte c leads to q = p ^ offset(unit[p]) ^ c when unit[q]'s label is c;
// when unit[q] has a leaf, the key read so far ends there and unit[q ^ offset(unit[q])]
// holds its value. Children always stay in their parent's 256-unit block.
//
// The file is untrusted, so the constructor walks every state a text could reach once
// and checks that each unit it would read lies inside the array and each value points
// at a NUL-terminated replacement. Lookups then read the array without checks.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace forge {

class PrecompiledCharsmap {
 public:
  // Fails naming `where` when the blob is malformed.
  PrecompiledCharsmap(std::string_view blob, const std::string& where);

  // False when no rule starts with `byte`.
  bool may_start_with(uint8_t byte) const { return first_bytes_[byte]; }
  // The longest rule at the start of `text`: (bytes it replaces, replacement), or
  // (0, "") when none matches.
  std::pair<size_t, std::string_view> longest_match(std::string_view text) const;

 private:
  void validate(const std::string& where);

  std::vector<uint32_t> units_;
  std::string replacements_;
  std::array<bool, 256> first_bytes_{};
};

}  // namespace forge
