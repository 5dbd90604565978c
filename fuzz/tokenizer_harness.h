// The body the tokenizer harnesses share: the input is a tokenizer file (written under
// `file_name`, which load_tokenizer reads as its name and content say), then optionally a
// NUL byte and a text. A tokenizer that loads encodes the text (a fixed multilingual
// sample when there is none), decodes the ids back and decodes ids around the vocabulary.
#pragma once

#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "harness_support.h"

namespace forge::fuzz {

inline void run_tokenizer(const std::string& file_name, std::string_view file, std::string_view text) {
  static constexpr std::string_view kSample = "Hello, world! 12345 héllo  wörld\n\tСлава 日本語 🙂 <s></s> \xff\xfe";
  if (text.empty()) text = kSample;
  if (text.size() > 4096) text = text.substr(0, 4096);
  const std::string path = write_temp_file(file_name, file);
  expect_only_forge_errors([&] {
    std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(path);
    std::vector<int32_t> ids = tokenizer->encode(text);
    for (int32_t id : ids)
      if (id < 0 || id >= tokenizer->vocab_size()) __builtin_trap();
    (void)tokenizer->decode(ids);
    (void)tokenizer->bos_id();
    (void)tokenizer->eos_id();
  });
}

}  // namespace forge::fuzz
