// The ids of recently encoded words, shared by the threads of encode_batch.
//
// NOTE [BPE word cache]
// Natural text repeats words, so the ids of each word up to 256 bytes are cached. The
// cache is split into shards, each behind its own mutex, so encode_batch threads rarely
// meet; when they do, the one that finds the shard locked does not wait (a descheduled
// holder would stall it) but treats the word as not cached, computes its ids, and skips
// inserting them. The cache only ever holds exact results, so this changes nothing but
// time. A lookup is one probe into an open-addressing table (power-of-two size, linear
// probing, the word's hash stored in the slot) and one read each of the word's bytes and
// ids, which the shard keeps in two arrays; a node-based hash map cost a division and
// several cache misses per lookup. A shard's table starts small and doubles while it is
// half full, up to 32768 slots for 16384 words; a full shard is cleared rather than
// tracked for recency.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

class TokenCache {
 public:
  static constexpr size_t kMaxWordBytes = 256;

  static bool cacheable(std::string_view word) { return word.size() <= kMaxWordBytes; }
  // Appends the cached ids of `word` to `out` and returns true, or returns false (also
  // when another thread holds the word's shard).
  bool find(std::string_view word, std::vector<int32_t>& out);
  // `word` must be cacheable.
  void insert(std::string_view word, const std::vector<int32_t>& ids);

 private:
  struct Slot {
    uint64_t hash = 0;  // 0: empty (a word hashing to 0 is stored as 1)
    uint32_t word_offset = 0, ids_offset = 0;
    uint16_t word_length = 0, id_count = 0;
  };
  struct alignas(64) Shard {  // a cache line of its own: threads on other shards never touch it
    std::mutex mutex;
    std::vector<Slot> slots;  // empty until the first insert
    std::string words;
    std::vector<int32_t> ids;
    size_t used = 0;
  };
  static constexpr size_t kShards = 64;
  static constexpr size_t kFirstSlots = 1024;
  static constexpr size_t kMaxSlots = 32768;           // holding up to half as many words
  static constexpr size_t kMaxIdsPerShard = 1 << 22;  // keeps offsets in range

  static uint64_t hash(std::string_view word);
  // The slot holding `word`, or the empty slot where it would go.
  static Slot& probe(Shard& shard, std::string_view word, uint64_t hash);
  // Makes room for one more word: a first table, a doubled one, or a cleared one.
  static void make_room(Shard& shard, size_t more_ids);

  std::array<Shard, kShards> shards_;
};

}  // namespace forge
