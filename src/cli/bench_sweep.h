// Sweeps for `forge bench`: an override may list several values, comma-separated
// (--training.local_batch_size 1,2,4 --training.seq_len 4096,8192), and the bench runs
// every combination. Which keys may list values is NOTE [Sweep lists] in bench_sweep.cpp.
#pragma once

#include <string>
#include <vector>

#include "cli/config.h"

namespace forge {

struct SweepPoint {
  ConfigOverrides overrides;  // every key given, once, with this point's value, in the order given
  std::string args;           // the same as a command line: "--training.local_batch_size 2 --model.name llama3.1-8b"
};

// The cartesian product of the overrides' value lists. Order: the first key varies
// slowest and the last fastest, as nested loops written in the order the keys were given
// (1,2 x 4096,8192 gives (1,4096) (1,8192) (2,4096) (2,8192)). No overrides give one
// point with none. Throws forge::Error naming the key for an unknown key, a key given
// twice, a list on a key that takes one value, an empty or repeated list item, or an item
// its key does not accept.
std::vector<SweepPoint> expand_sweep(const ConfigOverrides& overrides);

}  // namespace forge
