// Megatron's indexed dataset (data/indexed_dataset.h): <prefix>.idx validated against
// <prefix>.bin, then every document boundary and (up to a bound) every token read back.
// The input: a 4-byte little-endian length n, n bytes of .idx, the rest .bin.
#include <algorithm>
#include <cstring>
#include <vector>

#include "data/indexed_dataset.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input = forge::fuzz::as_view(data, size);
  uint32_t idx_bytes = 0;
  if (input.size() >= 4) {
    std::memcpy(&idx_bytes, input.data(), 4);
    input.remove_prefix(4);
  }
  idx_bytes = std::min<uint32_t>(idx_bytes, static_cast<uint32_t>(input.size()));
  forge::fuzz::write_temp_file("data.idx", input.substr(0, idx_bytes));
  forge::fuzz::write_temp_file("data.bin", input.substr(idx_bytes));
  forge::fuzz::expect_only_forge_errors([&] {
    forge::IndexedDataset dataset(forge::fuzz::temp_dir() + "/data");
    for (int64_t i = 0; i <= dataset.num_documents(); ++i) (void)dataset.document_index(i);
    std::vector<int32_t> tokens;
    int64_t budget = 1 << 16;
    for (int64_t s = 0; s < dataset.num_sequences() && budget > 0; ++s) {
      const int64_t length = std::min(dataset.sequence_length(s), budget);
      (void)dataset.sequence_pointer(s);
      tokens.resize(static_cast<size_t>(length));
      dataset.read_tokens(s, 0, length, int64_t{1} << 31, tokens.data());
      budget -= std::max<int64_t>(length, 1);
    }
  });
  return 0;
}
