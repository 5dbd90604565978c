// A safetensors file (ckpt/safetensors.h): the header checks, then every tensor of a
// float dtype converted to fp32 (up to a bound on the elements).
#include <vector>

#include "ckpt/safetensors.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = forge::fuzz::write_temp_file("model.safetensors", forge::fuzz::as_view(data, size));
  forge::fuzz::expect_only_forge_errors([&] {
    forge::SafetensorsFile file(path);
    std::vector<float> values;
    for (const forge::SafetensorsEntry& entry : file.entries()) {
      if (file.find(entry.name) != &entry) __builtin_trap();
      if (entry.numel() > (1 << 20)) continue;
      values.resize(static_cast<size_t>(entry.numel()));
      forge::fuzz::expect_only_forge_errors([&] { file.read_as_float(entry, values.data()); });
    }
  });
  return 0;
}
