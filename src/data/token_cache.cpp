#include "data/token_cache.h"

#include <functional>

namespace forge {

uint64_t TokenCache::hash(std::string_view word) {
  const uint64_t h = std::hash<std::string_view>{}(word);
  return h == 0 ? 1 : h;
}

// The shard comes from the hash's top bits, the slot from its low bits.
TokenCache::Slot& TokenCache::probe(Shard& shard, std::string_view word, uint64_t hash) {
  const size_t mask = shard.slots.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    Slot& slot = shard.slots[i];
    if (slot.hash == 0) return slot;
    if (slot.hash == hash && slot.word_length == word.size() &&
        std::string_view(shard.words).substr(slot.word_offset, slot.word_length) == word)
      return slot;
  }
}

bool TokenCache::find(std::string_view word, std::vector<int32_t>& out) {
  const uint64_t h = hash(word);
  Shard& shard = shards_[h >> 58];
  std::unique_lock lock(shard.mutex, std::try_to_lock);
  if (!lock || shard.slots.empty()) return false;
  const Slot& slot = probe(shard, word, h);
  if (slot.hash == 0) return false;
  const int32_t* ids = shard.ids.data() + slot.ids_offset;
  out.insert(out.end(), ids, ids + slot.id_count);
  return true;
}

void TokenCache::make_room(Shard& shard, size_t more_ids) {
  const bool full = 2 * (shard.used + 1) > kMaxSlots || shard.ids.size() + more_ids > kMaxIdsPerShard;
  if (shard.slots.empty() || full) {
    shard.slots.assign(full ? kMaxSlots : kFirstSlots, Slot{});
    shard.words.clear(), shard.ids.clear();
    shard.used = 0;
  } else if (2 * (shard.used + 1) > shard.slots.size()) {
    std::vector<Slot> old(2 * shard.slots.size());
    old.swap(shard.slots);
    const size_t mask = shard.slots.size() - 1;
    for (const Slot& slot : old) {
      if (slot.hash == 0) continue;
      size_t i = slot.hash & mask;
      while (shard.slots[i].hash != 0) i = (i + 1) & mask;
      shard.slots[i] = slot;
    }
  }
}

void TokenCache::insert(std::string_view word, const std::vector<int32_t>& ids) {
  static_assert(kShards == 64, "the shard is the hash's top 6 bits");
  const uint64_t h = hash(word);
  Shard& shard = shards_[h >> 58];
  std::unique_lock lock(shard.mutex, std::try_to_lock);
  if (!lock || word.size() > kMaxWordBytes || ids.size() > UINT16_MAX) return;
  make_room(shard, ids.size());
  Slot& slot = probe(shard, word, h);
  if (slot.hash != 0) return;  // another thread's insert got here first
  slot = Slot{h, static_cast<uint32_t>(shard.words.size()), static_cast<uint32_t>(shard.ids.size()),
              static_cast<uint16_t>(word.size()), static_cast<uint16_t>(ids.size())};
  shard.words.append(word);
  shard.ids.insert(shard.ids.end(), ids.begin(), ids.end());
  ++shard.used;
}

}  // namespace forge
