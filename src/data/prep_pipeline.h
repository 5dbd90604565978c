// The threaded middle of `forge prep`: documents from a DocumentReader are tokenized on
// worker threads and handed back in their original order.
//
// One reader thread cuts the document stream into batches (about 1 MiB of text or 4096
// documents); `workers` threads each take a whole batch and encode its documents; the
// calling thread receives finished batches strictly by batch number, so the output order
// never depends on thread timing. Reading, tokenizing and writing overlap. At most
// 2 x workers batches exist at once (the reader waits), which bounds memory.
//
// The first exception thrown anywhere (a malformed line in the reader, a tokenizer
// failure, a write error in the consumer) stops every thread and is rethrown to the
// caller after all threads have joined.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/document_reader.h"
#include "data/tokenizer.h"

namespace forge {

struct TokenizedBatch {
  std::vector<std::string> texts;
  std::vector<std::string> locations;     // "file:line" of texts[i], when the reader has raw_lines
  std::vector<std::vector<int32_t>> ids;  // ids[i]: tokens of texts[i], no BOS/EOS
  std::vector<std::vector<uint8_t>> masks;  // filled by process_in_order's work, when it makes masks
  std::vector<std::string> errors;          // likewise: why texts[i] was refused, empty if it was not
  uint64_t file_bytes_read = 0;           // reader's input position after this batch
  uint64_t text_bytes = 0;
};

void tokenize_in_order(DocumentReader& reader, const Tokenizer& tokenizer, int workers,
                       const std::function<void(const TokenizedBatch&)>& consume);

// The same pipeline with another worker step: `work` fills a batch's outputs from its
// texts (on the worker threads, so it must be safe to run on several batches at once).
void process_in_order(DocumentReader& reader, int workers, const std::function<void(TokenizedBatch&)>& work,
                      const std::function<void(const TokenizedBatch&)>& consume);

}  // namespace forge
