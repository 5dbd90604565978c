// Corpus files as forge prep reads them (data/document_reader.h, data/input_stream.h):
// JSON Lines or text, plain, gzip or zstd. The input's first byte picks the file name and
// the options (low 3 bits: the suffix from kNames; bit 3: text_per_line; bit 4:
// skip_bad_lines; bit 5: the JSON key "content" instead of "text"), the rest is the file.
#include <string>

#include "data/document_reader.h"
#include "harness_support.h"

namespace {
constexpr const char* kNames[] = {"corpus.jsonl", "corpus.txt",     "corpus.jsonl.gz", "corpus.jsonl.zst",
                                  "corpus.txt.gz", "corpus.txt.zst", "corpus.json",     "corpus.ndjson.gz"};
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t selector = data[0];
  const std::string path = forge::fuzz::write_temp_file(kNames[selector & 7], forge::fuzz::as_view(data + 1, size - 1));
  forge::DocumentReaderOptions options;
  options.text_per_line = (selector & 8) != 0;
  options.skip_bad_lines = (selector & 16) != 0;
  if (selector & 32) options.json_key = "content";
  forge::fuzz::expect_only_forge_errors([&] {
    forge::DocumentReader reader({path}, options);
    std::string text;
    while (reader.next(text)) {
    }
    (void)reader.file_bytes_read();
  });
  return 0;
}
