#include "data/token_cache.h"

#include <utility>

namespace forge {

bool TokenCache::find(std::string_view word, std::vector<int32_t>& out) {
  Shard& s = shard(word);
  std::unique_lock lock(s.mutex, std::try_to_lock);
  if (!lock) return false;
  auto it = s.words.find(word);
  if (it == s.words.end()) return false;
  out.insert(out.end(), it->second.begin(), it->second.end());
  return true;
}

void TokenCache::insert(std::string_view word, std::vector<int32_t> ids) {
  Shard& s = shard(word);
  std::unique_lock lock(s.mutex, std::try_to_lock);
  if (!lock) return;
  if (s.words.size() >= kShardCapacity) s.words.clear();
  s.words.emplace(word, std::move(ids));
}

}  // namespace forge
