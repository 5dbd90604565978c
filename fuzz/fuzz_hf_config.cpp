// A Hugging Face config.json (ckpt/hf_config.h): read_hf_config turns it into a
// ModelConfig, which is then written back as a config.json.
#include "ckpt/hf_config.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  forge::fuzz::write_temp_file("config.json", forge::fuzz::as_view(data, size));
  forge::fuzz::expect_only_forge_errors([&] {
    forge::ModelConfig config = forge::read_hf_config(forge::fuzz::temp_dir());
    (void)forge::hf_config_from_model(config, "bfloat16").dump();
  });
  return 0;
}
