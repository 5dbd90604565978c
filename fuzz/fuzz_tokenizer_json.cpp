// A Hugging Face tokenizer.json (data/hf_tokenizer.h) through load_tokenizer, then encode
// and decode (tokenizer_harness.h). The input: tokenizer.json, optionally NUL and a text.
#include "tokenizer_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto [file, text] = forge::fuzz::split_at_nul(forge::fuzz::as_view(data, size));
  forge::fuzz::run_tokenizer("tokenizer.json", file, text);
  return 0;
}
