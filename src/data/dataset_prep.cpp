// prepare_dataset; see dataset_prep.h. This file owns the options' validation and the
// order of the work; reading and tokenizing are prep_pipeline.h's, writing the output
// (atomically: NOTE [Atomic dataset output]) is IndexedDatasetWriter's.
#include "data/dataset_prep.h"

#include <chrono>
#include <filesystem>
#include <system_error>

#include "core/error.h"
#include "core/parallel.h"
#include "data/document_reader.h"
#include "data/prep_pipeline.h"

namespace forge {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kMegatronUint16Limit = 65500;

void validate(const PrepOptions& options, const Tokenizer& tokenizer) {
  if (options.inputs.empty()) FORGE_FAIL("forge prep: give at least one --input file");
  for (const auto& input : options.inputs) {
    input_format(input);
    std::error_code error;
    if (!fs::is_regular_file(input, error)) FORGE_FAIL("{}: input file not found (or not a regular file)", input);
  }
  const std::string& prefix = options.output_prefix;
  if (prefix.empty()) FORGE_FAIL("forge prep: --output-prefix is empty: give the path prefix of the .bin/.idx files");
  for (const char* suffix : {".bin", ".idx"}) {
    if (prefix.size() > 4 && prefix.compare(prefix.size() - 4, 4, suffix) == 0)
      FORGE_FAIL("--output-prefix '{}' ends with {}: give the prefix without it; forge writes {}.bin and {}.idx",
                 prefix, suffix, prefix.substr(0, prefix.size() - 4), prefix.substr(0, prefix.size() - 4));
  }
  if (fs::is_directory(prefix))
    FORGE_FAIL("--output-prefix '{}' is a directory: give a file prefix such as {}/corpus", prefix, prefix);
  if (options.json_key.empty()) FORGE_FAIL("--json-key is empty: give the JSON key that holds the text");
  if (options.workers < 0) FORGE_FAIL("--workers is {}: expected a positive number of threads", options.workers);
  if (options.append_eod && !tokenizer.eos_id())
    FORGE_FAIL("the tokenizer defines no EOS token, which --append-eod appends to every document: pass "
               "--no-append-eod or use a tokenizer with an EOS token");
}

}  // namespace

uint64_t prep_input_bytes(const std::vector<std::string>& inputs) {
  uint64_t total = 0;
  for (const auto& path : inputs) {
    std::error_code error;
    const uintmax_t size = fs::file_size(path, error);
    if (!error) total += size;
  }
  return total;
}

IndexedDType token_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < kMegatronUint16Limit ? IndexedDType::U16 : IndexedDType::I32;
}

PrepSummary prepare_dataset(const PrepOptions& options, const Tokenizer& tokenizer,
                            const std::function<void(const PrepProgress&)>& on_progress) {
  validate(options, tokenizer);
  const auto start = std::chrono::steady_clock::now();
  auto seconds_since_start = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };

  const fs::path parent = fs::path(options.output_prefix).parent_path();
  if (!parent.empty()) fs::create_directories(parent);

  PrepSummary summary;
  summary.dtype = token_dtype_for_vocab(tokenizer.vocab_size());
  PrepProgress progress;
  progress.input_bytes_total = prep_input_bytes(options.inputs);

  IndexedDatasetWriter writer(options.output_prefix, summary.dtype);
  DocumentReader reader(options.inputs,
                        {.json_key = options.json_key,
                         .text_per_line = options.text_per_line,
                         .skip_bad_lines = options.skip_bad_lines});
  const std::optional<int32_t> eos = tokenizer.eos_id();
  const int workers = options.workers > 0 ? options.workers : num_threads();
  std::vector<int32_t> document;

  tokenize_in_order(reader, tokenizer, workers, [&](const TokenizedBatch& batch) {
    for (const auto& ids : batch.ids) {
      if (ids.empty()) {
        writer.end_document();
        ++summary.empty_documents;
      } else if (options.append_eod) {
        document.assign(ids.begin(), ids.end());
        document.push_back(*eos);
        writer.add_document(document);
        summary.tokens += static_cast<int64_t>(document.size());
      } else {
        writer.add_document(ids);
        summary.tokens += static_cast<int64_t>(ids.size());
      }
    }
    summary.documents += static_cast<int64_t>(batch.ids.size());
    summary.text_bytes += batch.text_bytes;
    if (on_progress) {
      progress.input_bytes_read = batch.file_bytes_read;
      progress.documents = summary.documents;
      progress.tokens = summary.tokens;
      progress.seconds = seconds_since_start();
      on_progress(progress);
    }
  });
  writer.finalize();

  summary.skipped_lines = reader.skipped_lines();
  summary.input_bytes = progress.input_bytes_total;
  summary.output_bytes = fs::file_size(options.output_prefix + ".bin") + fs::file_size(options.output_prefix + ".idx");
  summary.seconds = seconds_since_start();
  return summary;
}

}  // namespace forge
