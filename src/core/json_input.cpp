// Bounded JSON input; see NOTE [Bounded JSON input].
#include "core/json_input.h"

#include <array>
#include <cstring>

#include "core/error.h"
#include "core/input_file.h"

namespace forge {

namespace {

// The bytes that matter outside JSON strings: a quote opens a string, brackets and braces
// open and close levels. Everything else is skipped with one lookup.
constexpr std::array<bool, 256> kStructural = [] {
  std::array<bool, 256> structural{};
  for (char c : std::string_view("\"[]{}")) structural[static_cast<unsigned char>(c)] = true;
  return structural;
}();

// The closing quote of the string whose opening quote is at `open`, or nullptr when the
// string is not closed (the parser then reports it). A quote closes the string unless an
// odd run of backslashes precedes it; memchr skips the characters between quotes (most of
// a tokenizer.json's bytes) in bulk.
const char* string_end(const char* open, const char* end) {
  for (const char* quote = open + 1;; ++quote) {
    quote = static_cast<const char*>(std::memchr(quote, '"', static_cast<size_t>(end - quote)));
    if (!quote) return nullptr;
    const char* run = quote;
    while (run > open + 1 && run[-1] == '\\') --run;
    if ((quote - run) % 2 == 0) return quote;
  }
}

}  // namespace

void check_json_depth(std::string_view text, const std::string& source) {
  const char* const begin = text.data();
  const char* const end = begin + text.size();
  int depth = 0;
  for (const char* p = begin; p < end; ++p) {
    const char c = *p;
    if (!kStructural[static_cast<unsigned char>(c)]) continue;
    if (c == '"') {
      p = string_end(p, end);
      if (!p) return;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth)
        FORGE_FAIL("{}: JSON nested deeper than {} levels (at byte {})", source, kMaxJsonDepth, p - begin);
    } else if (depth > 0) {
      --depth;
    }
  }
}

nlohmann::json parse_json(std::string_view text, const std::string& source) {
  check_json_depth(text, source);
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    FORGE_FAIL("{}: not valid JSON: {}", source, e.what());
  }
}

nlohmann::json read_json_file(const std::string& path, std::string_view what) {
  return parse_json(read_regular_file(path, what), path);
}

std::string describe_json(const nlohmann::json& value) {
  constexpr size_t kMaxChars = 60;
  switch (value.type()) {
    case nlohmann::json::value_t::object:
      return fmt::format("an object of {} member{}", value.size(), value.size() == 1 ? "" : "s");
    case nlohmann::json::value_t::array:
      return fmt::format("a list of {} item{}", value.size(), value.size() == 1 ? "" : "s");
    case nlohmann::json::value_t::string: {
      const std::string& s = value.get_ref<const std::string&>();
      if (s.size() <= kMaxChars) return value.dump();
      size_t cut = kMaxChars;
      while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // whole UTF-8 characters
      return nlohmann::json(s.substr(0, cut)).dump() + "... (" + std::to_string(s.size()) + " bytes)";
    }
    default:
      return value.dump();
  }
}

}  // namespace forge
