// Corpus files as forge prep reads them (data/document_reader.h, data/input_stream.h):
// JSON Lines or text, plain, gzip or zstd. The input's first byte picks the file name and
// the options (low 3 bits: the suffix from kNames; bit 3: text_per_line; bit 4:
// skip_bad_lines; bit 5: the JSON key "content" instead of "text"; bits 6-7: the read
// buffer's size from kBufferBytes), the rest is the file.
// The buffer is never forge prep's 1 MiB: under ASan every allocation that large is a
// fresh mapping whose shadow is written on free, which cost this harness two thirds of its
// time; any input shorter than 64 KiB (every one the fuzzer makes here) reads the same
// through 64 KiB, and the smaller sizes make lines and compressed data cross refills.
#include <string>

#include "data/document_reader.h"
#include "harness_support.h"

namespace {
constexpr const char* kNames[] = {"corpus.jsonl", "corpus.txt",     "corpus.jsonl.gz", "corpus.jsonl.zst",
                                  "corpus.txt.gz", "corpus.txt.zst", "corpus.json",     "corpus.ndjson.gz"};
constexpr size_t kBufferBytes[] = {size_t{1} << 16, 4096, 64, 1};
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t selector = data[0];
  const std::string path = forge::fuzz::write_temp_file(kNames[selector & 7], forge::fuzz::as_view(data + 1, size - 1));
  forge::DocumentReaderOptions options;
  options.text_per_line = (selector & 8) != 0;
  options.skip_bad_lines = (selector & 16) != 0;
  if (selector & 32) options.json_key = "content";
  options.buffer_bytes = kBufferBytes[selector >> 6];
  forge::fuzz::expect_only_forge_errors([&] {
    forge::DocumentReader reader({path}, options);
    std::string text;
    while (reader.next(text)) {
    }
    (void)reader.file_bytes_read();
  });
  return 0;
}
