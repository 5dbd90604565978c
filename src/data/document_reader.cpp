// DocumentReader; see document_reader.h. Lines are cut from a 1 MiB buffer (by default) of
// decompressed bytes, so a line may be longer than the buffer (it is assembled across
// refills) and memory stays bounded by the longest line.
#include "data/document_reader.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "data/json_line.h"

namespace forge {

namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

}  // namespace

InputFormat input_format(const std::string& path) {
  const std::string name = without_compression_suffix(path);
  for (const char* suffix : {".jsonl", ".json", ".ndjson"})
    if (ends_with(name, suffix)) return InputFormat::JsonLines;
  for (const char* suffix : {".txt", ".text"})
    if (ends_with(name, suffix)) return InputFormat::Text;
  FORGE_FAIL("{}: unknown input format: expected a name ending in .jsonl, .json or .ndjson (JSON Lines) or .txt "
             "(plain text), optionally followed by .gz or .zst",
             path);
}

DocumentReader::DocumentReader(std::vector<std::string> paths, DocumentReaderOptions options)
    : paths_(std::move(paths)), options_(std::move(options)) {
  FORGE_CHECK(options_.buffer_bytes > 0, "DocumentReader with a buffer of 0 bytes");
  buffer_ = std::make_unique_for_overwrite<char[]>(options_.buffer_bytes);
  for (const auto& path : paths_) input_format(path);
}

DocumentReader::~DocumentReader() = default;

bool DocumentReader::open_next_file() {
  close_file();
  if (next_path_ == paths_.size()) return false;
  const std::string& path = paths_[next_path_++];
  format_ = input_format(path);
  stream_ = std::make_unique<InputStream>(path, std::max<size_t>(1, options_.buffer_bytes / 4));
  whole_file_read_ = false;
  line_number_ = 0;
  buffer_begin_ = buffer_end_ = 0;
  return true;
}

void DocumentReader::close_file() {
  if (!stream_) return;
  finished_files_bytes_ += stream_->file_bytes_read();
  stream_.reset();
}

bool DocumentReader::next_line(std::string& line) {
  line.clear();
  bool any = false;
  while (true) {
    if (buffer_begin_ == buffer_end_) {
      buffer_begin_ = 0;
      buffer_end_ = stream_->read(buffer_.get(), options_.buffer_bytes);
      if (buffer_end_ == 0) {
        if (any) ++line_number_;
        return any;
      }
    }
    any = true;
    const char* begin = buffer_.get() + buffer_begin_;
    const char* end = buffer_.get() + buffer_end_;
    const char* newline = static_cast<const char*>(std::memchr(begin, '\n', static_cast<size_t>(end - begin)));
    if (newline) {
      line.append(begin, newline);
      buffer_begin_ += static_cast<size_t>(newline - begin) + 1;
      ++line_number_;
      return true;
    }
    line.append(begin, end);
    buffer_begin_ = buffer_end_;
  }
}

bool DocumentReader::next_from_json_lines(std::string& text) {
  std::string line;
  while (next_line(line)) {
    if (is_blank(line)) continue;
    if (options_.raw_lines) {
      text = std::move(line);
      return true;
    }
    const std::string problem = json_line_text(line, options_.json_key, text);
    if (problem.empty()) return true;
    if (!options_.skip_bad_lines)
      FORGE_FAIL("{}:{}: {} (pass --skip-bad-lines to skip such lines)", stream_->path(), line_number_, problem);
    if (skipped_lines_ < 10) log_warn("{}:{}: skipped: {}", stream_->path(), line_number_, problem);
    ++skipped_lines_;
  }
  return false;
}

bool DocumentReader::next_from_text(std::string& text) {
  if (options_.text_per_line) {
    while (next_line(text)) {
      if (!text.empty() && text.back() == '\r') text.pop_back();
      if (!text.empty()) return true;
    }
    return false;
  }
  if (whole_file_read_) return false;
  whole_file_read_ = true;
  text.clear();
  while (true) {
    const size_t n = stream_->read(buffer_.get(), options_.buffer_bytes);
    if (n == 0) return true;
    text.append(buffer_.get(), n);
  }
}

std::string DocumentReader::location() const {
  return stream_ ? fmt::format("{}:{}", stream_->path(), line_number_) : std::string("(no input open)");
}

bool DocumentReader::next(std::string& text) {
  while (true) {
    if (!stream_ && !open_next_file()) return false;
    if (format_ == InputFormat::JsonLines ? next_from_json_lines(text) : next_from_text(text)) return true;
    close_file();
  }
}

}  // namespace forge
