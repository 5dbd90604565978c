// TokenCache (NOTE [BPE word cache]): what it returns is always exactly what was inserted
// for that word, across table growth, collisions and clearing (1.5 million words fill
// every shard past its 16384), and from many threads.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "data/token_cache.h"

namespace forge {
namespace {

std::string word_of(int i) { return "w" + std::to_string(i * 7919) + std::string(i % 13, 'x'); }

std::vector<int32_t> ids_of(int i) {
  std::vector<int32_t> ids(1 + i % 5);
  for (size_t k = 0; k < ids.size(); ++k) ids[k] = i * 10 + static_cast<int32_t>(k);
  return ids;
}

TEST(TokenCache, ReturnsExactlyWhatWasInsertedForTheWord) {
  TokenCache cache;
  std::vector<int32_t> out;
  EXPECT_FALSE(cache.find("absent", out));
  for (int i = 0; i < 1500000; ++i) {
    cache.insert(word_of(i), ids_of(i));
    out.clear();
    ASSERT_TRUE(cache.find(word_of(i), out)) << i;
    ASSERT_EQ(out, ids_of(i)) << i;
  }
  int found = 0;
  for (int i = 0; i < 1500000; i += 97) {
    out = {-1};
    if (!cache.find(word_of(i), out)) continue;
    ++found;
    std::vector<int32_t> expected{-1};
    for (int32_t id : ids_of(i)) expected.push_back(id);
    ASSERT_EQ(out, expected) << i;
  }
  EXPECT_GT(found, 0);
  const std::string long_word(TokenCache::kMaxWordBytes + 1, 'a');
  EXPECT_FALSE(TokenCache::cacheable(long_word));
  cache.insert(long_word, {1});
  EXPECT_FALSE(cache.find(long_word, out));
}

TEST(TokenCache, ThreadsSeeOnlyExactResults) {
  TokenCache cache;
  std::vector<std::thread> threads;
  std::vector<int> wrong(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<int32_t> out;
      for (int i = 0; i < 200000; ++i) {
        const int word = (i * (t + 1)) % 50000;
        out.clear();
        if (cache.find(word_of(word), out)) {
          wrong[t] += out != ids_of(word);
        } else {
          cache.insert(word_of(word), ids_of(word));
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace forge
