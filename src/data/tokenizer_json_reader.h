// Validated access to a parsed tokenizer.json. Every accessor names the file and the place
// in it ("model.merges[12]") when a value is missing or has the wrong type, so a malformed
// or unsupported file fails with a message a user can act on.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace forge {

// NOTE [Bounded tokenizer pipelines]
// A normalizer or pre-tokenizer is a list of steps, possibly nested in Sequences. Real
// files have a handful; a crafted one can have thousands, nest Sequences deeply, or make
// each step multiply the text (a Replace whose pattern matches the empty string inserts
// its content between every two characters; one whose content contains its pattern, or a
// repeated ByteLevel, grows it again at every step), which takes time and memory
// exponential in the number of steps. So a file may nest Sequences at most
// kMaxSequenceDepth deep and hold at most kMaxPipelineSteps steps per pipeline, a Replace
// that matches the empty string is refused when the file is loaded, and a text that a
// pipeline grows past check_pipeline_growth's bound is refused while encoding.
inline constexpr int kMaxSequenceDepth = 16;
inline constexpr size_t kMaxPipelineSteps = 64;

// Throws forge::Error "<file>: <pipeline> grew a text of N bytes to M bytes ..." when
// `bytes` exceeds 16 times the input plus 1 MiB.
void check_pipeline_growth(const std::string& file, std::string_view pipeline, size_t input_bytes, size_t bytes);

class TokenizerJsonReader {
 public:
  explicit TokenizerJsonReader(std::string file) : file_(std::move(file)) {}

  const std::string& file() const { return file_; }

  // Throws forge::Error "<file>: <where>: <what>".
  [[noreturn]] void fail(std::string_view where, std::string_view what) const;

  const nlohmann::json& object(const nlohmann::json& parent, std::string_view where, const char* key) const;
  std::string string(const nlohmann::json& parent, std::string_view where, const char* key) const;
  // The member as a string, or `fallback` when it is absent or null.
  std::string string_or(const nlohmann::json& parent, std::string_view where, const char* key,
                        const std::string& fallback) const;
  bool boolean_or(const nlohmann::json& parent, std::string_view where, const char* key, bool fallback) const;
  int64_t integer(const nlohmann::json& parent, std::string_view where, const char* key) const;

  // The "type" member of a component, e.g. "ByteLevel" for a pre_tokenizer.
  std::string type(const nlohmann::json& component, std::string_view where) const;
  [[noreturn]] void unsupported_type(std::string_view where, std::string_view type, std::string_view supported) const;

 private:
  const nlohmann::json& member(const nlohmann::json& parent, std::string_view where, const char* key) const;
  std::string file_;
};

}  // namespace forge
