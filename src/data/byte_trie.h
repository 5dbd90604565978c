// A set of byte strings with a value each, searched for the keys that begin at a given
// position of a text: the pieces a unigram lattice can place there, or the user-defined
// symbol that SentencePiece matches greedily before anything else.
//
// NOTE [Double-array trie]
// The trie is a double array: state s moves on byte c to t = base[s] + c when check[t] == s,
// and value[t] is the value of the key that ends at t (-1 where none ends). A walk costs
// one array read and one compare per byte and touches no pointers, which is what makes
// SentencePiece's own tries (darts-clone) fast; this one is built by forge from the keys
// (darts-clone's packed units are read only for the precompiled charsmap, which arrives
// already built). Building places each node's children at the lowest base whose slots
// are all free, finding free slots through a "next free slot" array with path compression.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace forge {

class ByteTrie {
 public:
  ByteTrie() = default;
  // `keys` must be non-empty strings, each once.
  explicit ByteTrie(std::vector<std::pair<std::string, int32_t>> keys);

  bool empty() const { return units_.empty(); }
  // False when no key starts with `byte`: a walk from there would find nothing.
  bool may_start_with(uint8_t byte) const { return first_bytes_[byte]; }

  // Calls on_match(length, value) for every key that is a prefix of `text`, shortest first.
  template <typename OnMatch>
  void for_each_prefix(std::string_view text, OnMatch&& on_match) const {
    if (units_.empty()) return;
    uint32_t state = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      const uint32_t next = static_cast<uint32_t>(units_[state].base) + static_cast<uint8_t>(text[i]);
      if (units_[next].check != static_cast<int32_t>(state)) return;
      state = next;
      if (units_[state].value >= 0) on_match(i + 1, units_[state].value);
    }
  }

  // Length of the longest key that is a prefix of `text`, 0 when none is.
  size_t longest_prefix(std::string_view text) const;

 private:
  struct Unit {
    int32_t base = 0;
    int32_t check = -1;  // the state this unit is a child of; -1 for a free slot
    int32_t value = -1;
  };
  using Keys = std::vector<std::pair<std::string, int32_t>>;

  void place_children(int32_t state, const Keys& keys, size_t begin, size_t end, size_t depth);
  int32_t find_base(const std::vector<uint8_t>& labels);
  int32_t next_free(int32_t slot);
  void grow(size_t size);

  std::vector<Unit> units_;
  std::vector<int32_t> next_free_;  // building only: a slot at or after i that may be free
  std::array<bool, 256> first_bytes_{};
};

}  // namespace forge
