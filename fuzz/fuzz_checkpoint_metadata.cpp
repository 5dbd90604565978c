// A checkpoint's metadata.json and shard (ckpt/checkpoint.h): open_checkpoint's checks
// of step-1/metadata.json against step-1/rank-0.bin, then the first elements of each flat
// vector read back with their CRCs. The input: metadata.json, a NUL byte, rank-0.bin.
#include <algorithm>
#include <filesystem>
#include <vector>

#include "ckpt/checkpoint.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool made = std::filesystem::create_directories(forge::fuzz::temp_dir() + "/step-1");
  (void)made;
  auto [metadata, shard] = forge::fuzz::split_at_nul(forge::fuzz::as_view(data, size));
  forge::fuzz::write_temp_file("step-1/metadata.json", metadata);
  forge::fuzz::write_temp_file("step-1/rank-0.bin", shard);
  forge::fuzz::expect_only_forge_errors([&] {
    forge::Checkpoint checkpoint = forge::open_checkpoint(forge::fuzz::temp_dir() + "/step-1");
    std::vector<float> values(static_cast<size_t>(std::min<int64_t>(checkpoint.metadata.flat_numel, 4096)));
    for (forge::FlatState state : {forge::FlatState::Param, forge::FlatState::ExpAvg, forge::FlatState::ExpAvgSq})
      forge::read_flat_range(checkpoint, state, 0, values);
  });
  return 0;
}
