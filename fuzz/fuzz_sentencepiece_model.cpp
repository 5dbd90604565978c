// A SentencePiece tokenizer.model (a protobuf: data/sentencepiece_model_proto.h) through
// load_tokenizer, then encode and decode (tokenizer_harness.h). The input is the whole
// file (protobuf bytes may hold NULs); the text is the fixed sample.
#include "tokenizer_harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  forge::fuzz::run_tokenizer("tokenizer.model", forge::fuzz::as_view(data, size), {});
  return 0;
}
