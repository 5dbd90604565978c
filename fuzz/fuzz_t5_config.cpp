// The T5 encoder's config.json (model/t5_config.h): read_t5_config, then the parameter
// count of what it accepted.
#include "harness_support.h"
#include "model/t5_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = forge::fuzz::write_temp_file("config.json", forge::fuzz::as_view(data, size));
  forge::fuzz::expect_only_forge_errors([&] { (void)forge::read_t5_config(path).parameter_count(); });
  return 0;
}
