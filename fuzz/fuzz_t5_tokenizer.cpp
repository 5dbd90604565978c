// FLUX's T5 prompt tokenizer (data/t5_prompt_tokenizer.h) from a tokenizer.json (an input
// that starts with '{') or a spiece.model (anything else), then optionally a NUL byte and a
// caption (a fixed sample when there is none): encode and prompt_ids, every id checked to
// lie in the vocabulary.
#include <cstdint>
#include <string>
#include <vector>

#include "data/t5_prompt_tokenizer.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static constexpr std::string_view kSample =
      "A photo of a café, 12345 <extra_id_0>  ｆｕｌｌ\t日本語 🙂 </s>";
  const std::string_view input = forge::fuzz::as_view(data, size);
  const bool json = !input.empty() && input.front() == '{';
  const auto parts = json ? forge::fuzz::split_at_nul(input) : std::pair{input, std::string_view()};
  const std::string_view file = parts.first;
  std::string_view text = parts.second;
  if (text.empty()) text = kSample;
  if (text.size() > 4096) text = text.substr(0, 4096);
  const std::string path = forge::fuzz::write_temp_file(json ? "tokenizer.json" : "spiece.model", file);
  forge::fuzz::expect_only_forge_errors([&] {
    const forge::T5PromptTokenizer tokenizer(path);
    std::vector<int32_t> ids = tokenizer.encode(text);
    const std::vector<int32_t> prompt = tokenizer.prompt_ids(text, 16);
    ids.insert(ids.end(), prompt.begin(), prompt.end());
    for (int32_t id : ids)
      if (id < 0 || id >= tokenizer.vocab_size()) __builtin_trap();
  });
  return 0;
}
