// model.safetensors.index.json of a sharded Hugging Face checkpoint (ckpt/hf_weight_files.h),
// checked against two small shards the harness writes once: model-00001-of-00002.safetensors
// ("model.embed_tokens.weight", "model.norm.weight") and model-00002-of-00002.safetensors
// ("lm_head.weight").
#include <filesystem>
#include <vector>

#include "ckpt/hf_weight_files.h"
#include "harness_support.h"

namespace {

std::string weights_dir() {
  const std::string dir = forge::fuzz::temp_dir() + "/weights";
  std::filesystem::create_directories(dir);
  static const std::vector<float> values(16, 0.5f);
  forge::write_safetensors(dir + "/model-00001-of-00002.safetensors",
                           {{"model.embed_tokens.weight", {4, 2}, values.data()}, {"model.norm.weight", {2}, values.data()}},
                           forge::SafetensorsDType::BF16, {{"format", "pt"}});
  forge::write_safetensors(dir + "/model-00002-of-00002.safetensors", {{"lm_head.weight", {4, 2}, values.data()}},
                           forge::SafetensorsDType::F32, {{"format", "pt"}});
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = weights_dir();
  forge::fuzz::write_temp_file("weights/model.safetensors.index.json", forge::fuzz::as_view(data, size));
  forge::fuzz::expect_only_forge_errors([&] {
    forge::HfWeightFiles files(dir);
    for (const forge::LocatedTensor& located : files.all()) (void)files.find(located.entry->name);
  });
  return 0;
}
