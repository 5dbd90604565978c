#include "data/precompiled_charsmap.h"

#include <bit>
#include <cstring>

#include "core/error.h"

namespace forge {

static_assert(std::endian::native == std::endian::little, "the charsmap's units are little-endian");

namespace {

constexpr size_t kMaxMatches = 32;  // sentencepiece's Normalizer::kMaxTrieResultsSize

// Fields of a darts-clone unit, NOTE [Precompiled charsmap].
bool has_leaf(uint32_t unit) { return (unit >> 8) & 1; }
uint32_t leaf_value(uint32_t unit) { return unit & 0x7FFFFFFFu; }
uint32_t label(uint32_t unit) { return unit & 0x800000FFu; }
uint32_t offset(uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); }

}  // namespace

PrecompiledCharsmap::PrecompiledCharsmap(std::string_view blob, const std::string& where) {
  uint32_t trie_bytes = 0;
  if (blob.size() > sizeof(trie_bytes)) std::memcpy(&trie_bytes, blob.data(), sizeof(trie_bytes));
  if (blob.size() <= sizeof(trie_bytes) || trie_bytes == 0 || trie_bytes % 4 != 0 ||
      trie_bytes > blob.size() - sizeof(trie_bytes))
    FORGE_FAIL("{}: the blob ({} bytes) does not hold the trie of {} bytes its header announces", where, blob.size(),
               trie_bytes);
  units_.resize(trie_bytes / 4);
  std::memcpy(units_.data(), blob.data() + sizeof(trie_bytes), trie_bytes);
  replacements_ = blob.substr(sizeof(trie_bytes) + trie_bytes);
  validate(where);
}

// Walks every node a text can reach (NOTE [Precompiled charsmap]); a node is the position
// its children are found from.
void PrecompiledCharsmap::validate(const std::string& where) {
  const size_t size = units_.size();
  const size_t last_nul = replacements_.rfind('\0');
  auto check_node = [&](uint32_t node, uint32_t from) {
    if ((node | 0xFFu) >= size)
      FORGE_FAIL("{}: trie unit {} leads to unit {}, outside the trie's {} units", where, from, node, size);
  };
  const uint32_t root = offset(units_[0]);
  check_node(root, 0);
  std::vector<bool> visited(size, false);
  std::vector<uint32_t> pending{root};
  visited[root] = true;
  while (!pending.empty()) {
    const uint32_t node = pending.back();
    pending.pop_back();
    for (uint32_t byte = 0; byte < 256; ++byte) {
      const uint32_t position = node ^ byte;
      const uint32_t unit = units_[position];
      if (label(unit) != byte) continue;
      if (node == root) first_bytes_[byte] = true;
      const uint32_t child = position ^ offset(unit);
      check_node(child, position);
      if (has_leaf(unit)) {
        const uint32_t value = leaf_value(units_[child]);
        if (last_nul == std::string::npos || value > last_nul)
          FORGE_FAIL("{}: trie unit {} points at replacement offset {}, past the last NUL-terminated replacement "
                     "({} bytes of replacements)",
                     where, child, value, replacements_.size());
      }
      if (!visited[child]) visited[child] = true, pending.push_back(child);
    }
  }
}

std::pair<size_t, std::string_view> PrecompiledCharsmap::longest_match(std::string_view text) const {
  size_t longest = 0, matches = 0;
  uint32_t value = 0;
  uint32_t node = offset(units_[0]);
  for (size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<uint8_t>(text[i]);
    node ^= byte;
    const uint32_t unit = units_[node];
    if (label(unit) != byte) break;
    node ^= offset(unit);
    if (has_leaf(unit)) {
      if (matches++ < kMaxMatches) longest = i + 1, value = leaf_value(units_[node]);
    }
  }
  if (longest == 0) return {0, {}};
  return {longest, std::string_view(replacements_.data() + value)};
}

}  // namespace forge
