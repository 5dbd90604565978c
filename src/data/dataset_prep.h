// Dataset preparation (`forge prep`): text corpora in, a Megatron indexed dataset
// (<prefix>.bin / <prefix>.idx) out, as Megatron-LM's tools/preprocess_data.py makes
// them, so that forge, megatron-core and every tool that reads MMIDIDX files can train on
// the result.
//
// What is written, document by document in input order: the tokenizer's ids for the
// text (no BOS), then the tokenizer's EOS when append_eod is set (Megatron's
// --append-eod). Each document is one sequence. A document whose text has no tokens is
// written as Megatron writes it: a document of zero sequences, without EOS. The token
// dtype follows Megatron's DType.optimal_dtype: uint16 when the vocabulary has fewer
// than 65500 ids, else int32.
//
// How: one thread reads documents (document_reader.h) and groups them into batches of
// about 1 MiB of text; `workers` threads tokenize batches; the calling thread writes
// batches in the order they were read. At most 2 x workers batches are in flight, so
// memory stays bounded whatever the corpus size.
//
// --prepend-bos (prepend_bos) puts the tokenizer's BOS id in front of every non-empty
// document that does not already start with it.
//
// format Sft (`forge prep --format sft`) reads instruction examples instead, one per JSON
// Lines line (sft_example.h), renders them (sft_tokenize.h, chat_template.h) and writes
// tokens plus a loss mask as two datasets (sft_dataset_writer.h), with `seq_len` /
// `overlong` deciding what happens to examples longer than a training sample.
//
// The output is written atomically: a failed or interrupted run leaves the dataset
// already at the prefix as it was and never a .bin/.idx pair that looks complete but is
// not (NOTE [Atomic dataset output] in data/indexed_dataset.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/indexed_dataset.h"
#include "data/sft_tokenize.h"
#include "data/tokenizer.h"

namespace forge {

enum class PrepFormat { Text, Sft };

struct PrepOptions {
  PrepFormat format = PrepFormat::Text;
  std::vector<std::string> inputs;  // JSON Lines or text files, optionally .gz / .zst
  std::string output_prefix;        // writes <output_prefix>.bin and <output_prefix>.idx
  std::string json_key = "text";
  bool append_eod = true;
  bool text_per_line = false;
  bool skip_bad_lines = false;
  int workers = 0;  // tokenizing threads; 0: num_threads()
  bool prepend_bos = false;
  // Sft only: rendering (the chat template, chosen by choose_chat_template) and length.
  SftEncoderOptions sft;
  int64_t seq_len = 0;  // 0: no limit
  Overlong overlong = Overlong::Truncate;
};

// Where a run stands; handed to the progress callback after every written batch.
struct PrepProgress {
  uint64_t input_bytes_read = 0;   // of the input files as stored (compressed or not)
  uint64_t input_bytes_total = 0;  // sum of the input files' sizes
  int64_t documents = 0;
  int64_t tokens = 0;
  double seconds = 0;
};

struct PrepSummary {
  int64_t documents = 0;
  int64_t empty_documents = 0;  // texts without tokens (written as zero-sequence documents)
  int64_t tokens = 0;           // EOS included
  int64_t skipped_lines = 0;
  uint64_t input_bytes = 0;
  uint64_t text_bytes = 0;  // decompressed text handed to the tokenizer
  uint64_t output_bytes = 0;  // .bin + .idx
  IndexedDType dtype = IndexedDType::U16;
  double seconds = 0;
  // Sft only (documents above counts the examples written):
  int64_t examples_read = 0;        // lines parsed, skipped bad lines not included
  int64_t truncated = 0;            // overlong, cut to seq_len + 1 tokens
  int64_t dropped_overlong = 0;     // overlong with overlong = Drop
  int64_t dropped_no_response = 0;  // no response token left after truncation
  int64_t response_tokens = 0;      // mask ones written
};

// The inputs' total size as stored (the progress total); a file that cannot be read
// counts 0 here and is reported by prepare_dataset.
uint64_t prep_input_bytes(const std::vector<std::string>& inputs);

// Megatron's DType.optimal_dtype: uint16 below 65500 ids, else int32.
IndexedDType token_dtype_for_vocab(int64_t vocab_size);

// Runs the preparation. `tokenizer` is used from several threads at once (encode is
// const). Fails, leaving the disk as NOTE [Atomic dataset output] says, on a bad option,
// an unreadable or malformed input (naming file:line), or a failed write.
PrepSummary prepare_dataset(const PrepOptions& options, const Tokenizer& tokenizer,
                            const std::function<void(const PrepProgress&)>& on_progress = {});

}  // namespace forge
