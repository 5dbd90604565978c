// DocumentReader: the documents of a corpus, in order, from a list of input files. This
// is the reading half of `forge prep`; tokenizing and writing are dataset_prep.h's.
//
// Formats, chosen by the file name once a .gz or .zst suffix is removed:
//   .jsonl, .json, .ndjson   JSON Lines: one JSON object per line; the document is the
//                            string under the JSON key (default "text"), as Megatron's
//                            preprocess_data.py reads its --input with Python's json
//                            (NaN, Infinity, huge numbers, duplicate keys: json_line.h).
//                            Lines holding only whitespace are skipped. A line that is
//                            not a JSON object, lacks the key or whose value is not a
//                            string is an error naming file:line, or with skip_bad_lines
//                            counted and skipped.
//   .txt, .text              plain text: the whole file is one document (bytes as
//                            they are, trailing newline included), or with
//                            text_per_line every non-empty line is one (its "\n" or
//                            "\r\n" removed).
// Anything else is refused before a byte is read, naming the file and the suffixes known.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/input_stream.h"

namespace forge {

enum class InputFormat { JsonLines, Text };

// The format of `path` by its suffix; fails naming the path and the known suffixes.
InputFormat input_format(const std::string& path);

struct DocumentReaderOptions {
  std::string json_key = "text";
  bool text_per_line = false;
  bool skip_bad_lines = false;
  // JSON Lines: every non-blank line is returned whole, unparsed (the caller parses it;
  // `forge prep --format sft`), and location() names it.
  bool raw_lines = false;
  // The buffer of decompressed bytes that lines are cut from; a compressed file is read a
  // quarter of this at a time. Tests and fuzz_document_reader make it small, so that
  // lines and compressed data cross refills within small inputs.
  size_t buffer_bytes = size_t{1} << 20;
};

class DocumentReader {
 public:
  // Checks every path's format up front; opens the files one after another as it reads.
  DocumentReader(std::vector<std::string> paths, DocumentReaderOptions options);
  ~DocumentReader();

  // The next document's text; false after the last document of the last file.
  bool next(std::string& text);
  // Bytes of the input files (as stored, compressed or not) consumed so far.
  uint64_t file_bytes_read() const { return finished_files_bytes_ + (stream_ ? stream_->file_bytes_read() : 0); }
  // "file:line" of the document next() returned last (JSON Lines and --text-per-line).
  std::string location() const;
  bool raw_lines() const { return options_.raw_lines; }
  // Lines skipped as malformed (only with skip_bad_lines).
  int64_t skipped_lines() const { return skipped_lines_; }

 private:
  bool open_next_file();
  bool next_line(std::string& line);
  bool next_from_json_lines(std::string& text);
  bool next_from_text(std::string& text);
  void close_file();

  std::vector<std::string> paths_;
  DocumentReaderOptions options_;
  size_t next_path_ = 0;
  std::unique_ptr<InputStream> stream_;
  InputFormat format_ = InputFormat::Text;
  bool whole_file_read_ = false;
  int64_t line_number_ = 0;
  std::unique_ptr<char[]> buffer_;  // options_.buffer_bytes, not zeroed (only what a read fills is used)
  size_t buffer_begin_ = 0, buffer_end_ = 0;
  uint64_t finished_files_bytes_ = 0;
  int64_t skipped_lines_ = 0;
};

}  // namespace forge
