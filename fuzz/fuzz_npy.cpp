// NumPy .npy files (data/npy_array.h): the header parser on the raw bytes, then, on the
// file, an integer array read back in full (up to a bound) or an object array's pickled
// records decoded (data/npy_records.h). The input: one whole .npy file.
#include <algorithm>
#include <vector>

#include "data/npy_array.h"
#include "data/npy_records.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = forge::fuzz::as_view(data, size);
  forge::fuzz::expect_only_forge_errors([&] {
    const forge::NpyHeader header = forge::parse_npy_header(input, "input.npy", true);
    const std::string path = forge::fuzz::write_temp_file("input.npy", input);
    if (header.kind == forge::NpyKind::Object) {
      forge::read_npy_records(path, [](int64_t, const forge::NpyRecord& record) { (void)record.size(); });
      return;
    }
    forge::NpyArray array(path);
    std::vector<int64_t> values(static_cast<size_t>(std::min<int64_t>(array.count(), 1 << 16)));
    array.read(0, static_cast<int64_t>(values.size()), values.data());
  });
  return 0;
}
