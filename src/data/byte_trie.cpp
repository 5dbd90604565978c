#include "data/byte_trie.h"

#include <algorithm>

#include "core/error.h"

namespace forge {
namespace {

constexpr int32_t kRootCheck = -2;  // no state is the root's parent

}  // namespace

ByteTrie::ByteTrie(Keys keys) {
  if (keys.empty()) return;
  std::sort(keys.begin(), keys.end());
  for (size_t i = 0; i < keys.size(); ++i) {
    FORGE_CHECK(!keys[i].first.empty(), "ByteTrie keys must not be empty");
    FORGE_CHECK(i == 0 || keys[i].first != keys[i - 1].first, "ByteTrie key '{}' is given twice", keys[i].first);
    first_bytes_[static_cast<uint8_t>(keys[i].first[0])] = true;
  }
  grow(256);
  units_[0].check = kRootCheck;
  next_free_[0] = 1;
  place_children(0, keys, 0, keys.size(), 0);
  next_free_ = {};
}

void ByteTrie::grow(size_t size) {
  if (units_.size() >= size) return;
  const size_t old_size = units_.size();
  units_.resize(size);
  next_free_.resize(size);
  for (size_t i = old_size; i < size; ++i) next_free_[i] = static_cast<int32_t>(i);
}

int32_t ByteTrie::next_free(int32_t slot) {
  grow(static_cast<size_t>(slot) + 1);
  int32_t free = slot;
  while (next_free_[free] != free) free = next_free_[free];
  while (next_free_[slot] != free) {
    const int32_t next = next_free_[slot];
    next_free_[slot] = free;
    slot = next;
  }
  return free;
}

// The lowest base >= 1 at which every label's slot is free. Candidates come from the free
// slots for the first label, so occupied stretches are skipped in one step.
int32_t ByteTrie::find_base(const std::vector<uint8_t>& labels) {
  const int32_t first = labels.front();
  for (int32_t slot = next_free(first + 1);; slot = next_free(slot + 1)) {
    const int32_t base = slot - first;
    grow(static_cast<size_t>(base) + 257);  // every slot of the base, and the one after the last
    bool fits = true;
    for (size_t i = 1; i < labels.size() && fits; ++i) fits = units_[base + labels[i]].check == -1;
    if (fits) return base;
  }
}

// `keys[begin, end)` share their first `depth` bytes, the path to `state`.
void ByteTrie::place_children(int32_t state, const Keys& keys, size_t begin, size_t end, size_t depth) {
  if (keys[begin].first.size() == depth) units_[state].value = keys[begin++].second;
  if (begin == end) return;
  std::vector<uint8_t> labels;
  std::vector<size_t> group_begins;
  for (size_t i = begin; i < end; ++i) {
    const auto label = static_cast<uint8_t>(keys[i].first[depth]);
    if (labels.empty() || labels.back() != label) labels.push_back(label), group_begins.push_back(i);
  }
  group_begins.push_back(end);
  const int32_t base = find_base(labels);
  units_[state].base = base;
  for (uint8_t label : labels) {
    const int32_t slot = base + label;
    units_[slot].check = state;
    next_free_[slot] = slot + 1;
  }
  for (size_t g = 0; g < labels.size(); ++g)
    place_children(base + labels[g], keys, group_begins[g], group_begins[g + 1], depth + 1);
}

size_t ByteTrie::longest_prefix(std::string_view text) const {
  size_t longest = 0;
  for_each_prefix(text, [&](size_t length, int32_t) { longest = length; });
  return longest;
}

}  // namespace forge
