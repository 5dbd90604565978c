// json_line_text (data/json_line.h): one line of a JSONL corpus, read as Python's
// json.loads reads it, and the text under "text".
#include <string>

#include "data/json_line.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text;
  forge::fuzz::expect_only_forge_errors([&] { forge::json_line_text(forge::fuzz::as_view(data, size), "text", text); });
  return 0;
}
