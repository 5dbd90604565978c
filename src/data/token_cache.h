// The ids of recently encoded words, shared by the threads of encode_batch.
//
// NOTE [BPE word cache]
// Natural text repeats words, so the ids of each word up to 256 bytes are cached. The
// cache is split into shards, each behind its own mutex, so encode_batch threads rarely
// meet; when they do, the one that finds the shard locked does not wait (a descheduled
// holder would stall it) but treats the word as not cached, computes its ids, and skips
// inserting them. The cache only ever holds exact results, so this changes nothing but
// time. A full shard is cleared rather than tracked for recency.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string_view>
#include <vector>

#include "data/string_map.h"

namespace forge {

class TokenCache {
 public:
  static constexpr size_t kMaxWordBytes = 256;

  static bool cacheable(std::string_view word) { return word.size() <= kMaxWordBytes; }
  // Appends the cached ids of `word` to `out` and returns true, or returns false (also
  // when another thread holds the word's shard).
  bool find(std::string_view word, std::vector<int32_t>& out);
  void insert(std::string_view word, std::vector<int32_t> ids);

 private:
  struct alignas(64) Shard {  // a cache line of its own: threads on other shards never touch it
    std::mutex mutex;
    StringMap<std::vector<int32_t>> words;
  };
  static constexpr size_t kShards = 64;
  static constexpr size_t kShardCapacity = 16384;

  Shard& shard(std::string_view word) { return shards_[StringHash{}(word) % kShards]; }

  std::array<Shard, kShards> shards_;
};

}  // namespace forge
