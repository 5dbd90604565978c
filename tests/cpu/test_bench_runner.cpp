#include <gtest/gtest.h>

#include <limits>
#include <set>

#include "bench/bench_runner.h"
#include "bench/median.h"

namespace forge {
namespace {

TEST(BenchMaxBatch, FindsTheLargestFittingSizeWithFewProbes) {
  for (int64_t largest : {0, 1, 2, 3, 5, 8, 13, 100, 1023, 1024}) {
    std::set<int64_t> probed;
    const int64_t found = find_max_micro_batch(
        [&](int64_t mb) {
          EXPECT_TRUE(probed.insert(mb).second) << "probed " << mb << " twice";
          EXPECT_GE(mb, 1);
          EXPECT_LE(mb, 1024);
          return mb <= largest;
        },
        1024);
    EXPECT_EQ(found, largest);
    EXPECT_LE(probed.size(), 22u) << largest;
  }
}

TEST(BenchMaxBatch, StopsAtTheLimit) {
  EXPECT_EQ(find_max_micro_batch([](int64_t) { return true; }, 6), 6);
  EXPECT_EQ(find_max_micro_batch([](int64_t mb) { return mb <= 5; }, 6), 5);
}

TEST(BenchMedian, MiddleValueOfTheFiniteOnes) {
  EXPECT_EQ(median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(median({4.0, 1.0, 2.0, 3.0}), 2.5);
  EXPECT_EQ(median({5.0, std::numeric_limits<double>::quiet_NaN(), 1.0}), 3.0);
  EXPECT_FALSE(median({}).has_value());
}

}  // namespace
}  // namespace forge
