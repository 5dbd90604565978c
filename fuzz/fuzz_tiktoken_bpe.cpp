// A tiktoken BPE file (Meta's Llama 3 tokenizer.model: data/tiktoken_bpe_file.h) through
// load_tokenizer, then encode and decode (tokenizer_harness.h). The input: the file,
// optionally NUL and a text (the file format is text, so a NUL ends it).
#include "tokenizer_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto [file, text] = forge::fuzz::split_at_nul(forge::fuzz::as_view(data, size));
  forge::fuzz::run_tokenizer("tokenizer.model", file, text);
  return 0;
}
