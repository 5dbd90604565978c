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
#include "core/log.h"
#include "data/prep_pipeline.h"
#include "data/sft_dataset_writer.h"

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
  if (options.prepend_bos && !tokenizer.bos_id())
    FORGE_FAIL("--prepend-bos: the tokenizer defines no BOS token (no BOS in its post-processor, tokenizer_config.json "
               "or usual names)");
  if (options.format == PrepFormat::Sft) {
    for (const auto& input : options.inputs)
      if (input_format(input) != InputFormat::JsonLines)
        FORGE_FAIL("{}: --format sft reads JSON Lines (.jsonl, .json, .ndjson, optionally .gz/.zst)", input);
    if (options.seq_len < 0) FORGE_FAIL("--seq-len is {}: expected a positive number of tokens", options.seq_len);
    if (options.json_key != "text" || options.text_per_line || !options.append_eod)
      FORGE_FAIL("--json-key, --text-per-line and --no-append-eod apply to --format text; --format sft reads whole "
                 "examples and ends each response with the template's end of turn (EOS without a template)");
    return;
  }
  if (options.seq_len != 0) FORGE_FAIL("--seq-len applies to --format sft");
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

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

void report_progress(const std::function<void(const PrepProgress&)>& on_progress, PrepProgress& progress,
                     const TokenizedBatch& batch, const PrepSummary& summary, Clock::time_point start) {
  if (!on_progress) return;
  progress.input_bytes_read = batch.file_bytes_read;
  progress.documents = summary.documents;
  progress.tokens = summary.tokens;
  progress.seconds = seconds_since(start);
  on_progress(progress);
}

void count_fit(SeqLenFit fit, PrepSummary& summary) {
  switch (fit) {
    case SeqLenFit::Fits: break;
    case SeqLenFit::Truncated: ++summary.truncated; break;
    case SeqLenFit::DroppedOverlong: ++summary.dropped_overlong; break;
    case SeqLenFit::DroppedNoResponse: ++summary.dropped_no_response; break;
  }
}

PrepSummary prepare_sft(const PrepOptions& options, const Tokenizer& tokenizer,
                        const std::function<void(const PrepProgress&)>& on_progress, Clock::time_point start) {
  PrepSummary summary;
  summary.dtype = token_dtype_for_vocab(tokenizer.vocab_size());
  PrepProgress progress;
  progress.input_bytes_total = prep_input_bytes(options.inputs);
  SftEncoderOptions encoder_options = options.sft;
  encoder_options.prepend_bos = options.prepend_bos;
  const SftEncoder encoder(tokenizer, encoder_options);
  SftDatasetWriter writer(options.output_prefix, summary.dtype);
  DocumentReader reader(options.inputs, {.skip_bad_lines = options.skip_bad_lines, .raw_lines = true});
  const int workers = options.workers > 0 ? options.workers : num_threads();
  int64_t skipped = 0;

  auto encode_batch = [&](TokenizedBatch& batch) {
    const size_t n = batch.texts.size();
    batch.ids.resize(n);
    batch.masks.resize(n);
    batch.errors.resize(n);
    for (size_t i = 0; i < n; ++i) {
      try {
        SftTokens tokens = encoder.encode_line(batch.texts[i]);
        batch.ids[i] = std::move(tokens.ids);
        batch.masks[i] = std::move(tokens.mask);
      } catch (const Error& error) {
        if (!options.skip_bad_lines)
          FORGE_FAIL("{}: {} (pass --skip-bad-lines to skip such lines)", batch.locations[i], error.what());
        batch.errors[i] = fmt::format("{}: {}", batch.locations[i], error.what());
      }
    }
  };
  process_in_order(reader, workers, encode_batch, [&](const TokenizedBatch& batch) {
    SftTokens example;
    for (size_t i = 0; i < batch.texts.size(); ++i) {
      if (!batch.errors[i].empty()) {
        if (skipped < 10) log_warn("{}: skipped", batch.errors[i]);
        ++skipped;
        continue;
      }
      ++summary.examples_read;
      example.ids = batch.ids[i];
      example.mask = batch.masks[i];
      const SeqLenFit fit = fit_to_seq_len(example, options.seq_len, options.overlong);
      count_fit(fit, summary);
      if (fit == SeqLenFit::DroppedOverlong || fit == SeqLenFit::DroppedNoResponse) continue;
      writer.add_example(example);
      ++summary.documents;
      summary.tokens += static_cast<int64_t>(example.ids.size());
      for (uint8_t m : example.mask) summary.response_tokens += m;
    }
    summary.text_bytes += batch.text_bytes;
    report_progress(on_progress, progress, batch, summary, start);
  });
  writer.finalize();
  summary.skipped_lines = skipped;
  summary.input_bytes = progress.input_bytes_total;
  summary.output_bytes = writer.output_bytes();
  return summary;
}

PrepSummary prepare_text(const PrepOptions& options, const Tokenizer& tokenizer,
                         const std::function<void(const PrepProgress&)>& on_progress, Clock::time_point start) {
  PrepSummary summary;
  summary.dtype = token_dtype_for_vocab(tokenizer.vocab_size());
  PrepProgress progress;
  progress.input_bytes_total = prep_input_bytes(options.inputs);

  IndexedDatasetWriter writer(options.output_prefix, summary.dtype);
  DocumentReader reader(options.inputs,
                        {.json_key = options.json_key,
                         .text_per_line = options.text_per_line,
                         .skip_bad_lines = options.skip_bad_lines});
  const std::optional<int32_t> eos = tokenizer.eos_id(), bos = tokenizer.bos_id();
  const int workers = options.workers > 0 ? options.workers : num_threads();
  std::vector<int32_t> document;

  tokenize_in_order(reader, tokenizer, workers, [&](const TokenizedBatch& batch) {
    for (const auto& ids : batch.ids) {
      if (ids.empty()) {
        writer.end_document();
        ++summary.empty_documents;
      } else if (options.append_eod || options.prepend_bos) {
        document.assign(ids.begin(), ids.end());
        if (options.prepend_bos) prepend_bos_once(document, *bos);
        if (options.append_eod) document.push_back(*eos);
        writer.add_document(document);
        summary.tokens += static_cast<int64_t>(document.size());
      } else {
        writer.add_document(ids);
        summary.tokens += static_cast<int64_t>(ids.size());
      }
    }
    summary.documents += static_cast<int64_t>(batch.ids.size());
    summary.text_bytes += batch.text_bytes;
    report_progress(on_progress, progress, batch, summary, start);
  });
  finalize_replacing_mask(writer, options.output_prefix);

  summary.skipped_lines = reader.skipped_lines();
  summary.input_bytes = progress.input_bytes_total;
  summary.output_bytes = fs::file_size(options.output_prefix + ".bin") + fs::file_size(options.output_prefix + ".idx");
  return summary;
}

}  // namespace

PrepSummary prepare_dataset(const PrepOptions& options, const Tokenizer& tokenizer,
                            const std::function<void(const PrepProgress&)>& on_progress) {
  validate(options, tokenizer);
  const Clock::time_point start = Clock::now();
  const fs::path parent = fs::path(options.output_prefix).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  PrepSummary summary = options.format == PrepFormat::Sft ? prepare_sft(options, tokenizer, on_progress, start)
                                                          : prepare_text(options, tokenizer, on_progress, start);
  summary.seconds = seconds_since(start);
  return summary;
}

}  // namespace forge
