// json_line_text: a single-pass scanner over one line of JSON with Python's json grammar
// (json_line.h, NOTE [Python's JSON]). Values are validated and skipped, except the
// string under the requested key, which is decoded.
#include "data/json_line.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "data/utf8.h"

namespace forge {
namespace {

enum class ValueType { Object, Array, String, Number, Boolean, Null };

// "an array", "null": the type as a message names it.
const char* described(ValueType type) {
  switch (type) {
    case ValueType::Object: return "an object";
    case ValueType::Array: return "an array";
    case ValueType::String: return "a string";
    case ValueType::Number: return "a number";
    case ValueType::Boolean: return "a boolean";
    case ValueType::Null: return "null";
  }
  return "a value";
}

// Whether any byte of `word` ends a run of plain string bytes: a control character, '"',
// '\\' or a byte of a multi-byte UTF-8 sequence (SWAR: eight bytes per test).
bool ends_plain_run(uint64_t word) {
  constexpr uint64_t ones = 0x0101010101010101ULL, high_bits = 0x8080808080808080ULL;
  const auto any_zero_byte = [&](uint64_t v) { return ((v - ones) & ~v & high_bits) != 0; };
  const bool any_below_space = ((word - ones * 0x20) & ~word & high_bits) != 0;
  return any_below_space || any_zero_byte(word ^ (ones * '"')) || any_zero_byte(word ^ (ones * '\\')) ||
         (word & high_bits) != 0;
}

bool is_plain_byte(uint8_t c) { return c >= 0x20 && c < 0x80 && c != '"' && c != '\\'; }

// Bytes of the UTF-8 sequence of `code_point`.
size_t utf8_length(int32_t code_point) {
  return code_point < 0x80 ? 1 : code_point < 0x800 ? 2 : code_point < 0x10000 ? 3 : 4;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class JsonLineScanner {
 public:
  explicit JsonLineScanner(std::string_view line) : s_(line) {}

  // False with problem() set when the line holds no document.
  bool text_under(std::string_view key, std::string& text);
  const std::string& problem() const { return problem_; }

 private:
  struct StringScan {
    std::string* decoded = nullptr;                     // where to decode the string, or null to only validate
    size_t lone_surrogate_at = std::string_view::npos;  // offset of the first lone surrogate escape
  };

  bool fail(std::string_view what) {
    problem_ = fmt::format("not valid JSON at byte offset {}: {}", pos_, what);
    return false;
  }
  bool at_end() const { return pos_ == s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }
  void skip_whitespace() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool consume(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  bool expect_colon() {
    skip_whitespace();
    if (!consume(":")) return fail("expected ':' after an object key");
    return true;
  }

  void skip_plain_bytes();
  bool scan_string(StringScan& scan);
  bool scan_escape(StringScan& scan);
  bool read_hex4(uint32_t& value);
  bool scan_number();
  bool scan_scalar(ValueType& type);
  bool scan_key(std::string_view wanted, bool& matches);
  bool skip_key();
  bool skip_value(ValueType& type);

  std::string_view s_;
  size_t pos_ = 0;
  std::string problem_;
  std::string key_buffer_;
};

bool JsonLineScanner::read_hex4(uint32_t& value) {
  if (s_.size() - pos_ < 4) return false;
  value = 0;
  for (size_t i = 0; i < 4; ++i) {
    const int digit = hex_value(s_[pos_ + i]);
    if (digit < 0) return false;
    value = value * 16 + static_cast<uint32_t>(digit);
  }
  pos_ += 4;
  return true;
}

// At the character after a backslash. A high surrogate followed by an escaped low
// surrogate is one code point; any other surrogate is lone, as in Python's scanstring.
bool JsonLineScanner::scan_escape(StringScan& scan) {
  if (at_end()) return fail("unterminated escape at the end of the line");
  const char escape = s_[pos_++];
  char plain = 0;
  switch (escape) {
    case '"': plain = '"'; break;
    case '\\': plain = '\\'; break;
    case '/': plain = '/'; break;
    case 'b': plain = '\b'; break;
    case 'f': plain = '\f'; break;
    case 'n': plain = '\n'; break;
    case 'r': plain = '\r'; break;
    case 't': plain = '\t'; break;
    case 'u': break;
    default:
      --pos_;
      return fail(fmt::format("invalid escape '\\{}' (expected one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)",
                              escape));
  }
  if (plain) {
    if (scan.decoded) scan.decoded->push_back(plain);
    return true;
  }
  const size_t escape_at = pos_ - 2;
  uint32_t code_point;
  if (!read_hex4(code_point)) return fail("expected 4 hex digits after \\u");
  if (code_point >= 0xD800 && code_point <= 0xDBFF && s_.substr(pos_, 2) == "\\u") {
    const size_t after_high = pos_;
    pos_ += 2;
    uint32_t low;
    if (!read_hex4(low)) return fail("expected 4 hex digits after \\u");
    if (low >= 0xDC00 && low <= 0xDFFF) {
      code_point = 0x10000 + ((code_point - 0xD800) << 10) + (low - 0xDC00);
    } else {
      pos_ = after_high;
    }
  }
  if (code_point >= 0xD800 && code_point <= 0xDFFF) {
    if (scan.lone_surrogate_at == std::string_view::npos) scan.lone_surrogate_at = escape_at;
    return true;
  }
  if (scan.decoded) utf8::append(*scan.decoded, code_point);
  return true;
}

void JsonLineScanner::skip_plain_bytes() {
  uint64_t word;
  while (s_.size() - pos_ >= sizeof(word)) {
    std::memcpy(&word, s_.data() + pos_, sizeof(word));
    if (ends_plain_run(word)) break;
    pos_ += sizeof(word);
  }
  while (!at_end() && is_plain_byte(static_cast<uint8_t>(s_[pos_]))) ++pos_;
}

// At the opening quote; ends after the closing one. Bytes that stand for themselves
// (plain ASCII, valid UTF-8) are copied to `decoded` in runs, between escapes.
bool JsonLineScanner::scan_string(StringScan& scan) {
  const size_t start = pos_++;
  size_t run = pos_;
  while (true) {
    skip_plain_bytes();
    if (at_end()) {
      pos_ = start;
      return fail("the string that starts here has no closing quote");
    }
    const auto c = static_cast<uint8_t>(s_[pos_]);
    if (c >= 0x80) {
      const int32_t code_point = utf8::code_point_at(s_, pos_);
      if (code_point < 0) return fail(fmt::format("invalid UTF-8 byte 0x{:02X}", c));
      pos_ += utf8_length(code_point);
      continue;
    }
    if (scan.decoded) scan.decoded->append(s_.substr(run, pos_ - run));
    if (c == '"') {
      ++pos_;
      return true;
    }
    if (c != '\\')
      return fail(fmt::format("control character 0x{:02X} inside a string (JSON writes it as an escape)", c));
    ++pos_;
    if (!scan_escape(scan)) return false;
    run = pos_;
  }
}

// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?, or Infinity / -Infinity.
bool JsonLineScanner::scan_number() {
  if (peek() == '-') ++pos_;
  if (consume("Infinity")) return true;
  if (peek() == '0') {
    ++pos_;
  } else if (is_digit(peek())) {
    while (is_digit(peek())) ++pos_;
  } else {
    return fail("expected a number (digits, NaN, Infinity or -Infinity)");
  }
  if (peek() == '.') {
    ++pos_;
    if (!is_digit(peek())) return fail("expected a digit after the decimal point");
    while (is_digit(peek())) ++pos_;
  }
  if (peek() == 'e' || peek() == 'E') {
    ++pos_;
    if (peek() == '+' || peek() == '-') ++pos_;
    if (!is_digit(peek())) return fail("expected a digit in the exponent");
    while (is_digit(peek())) ++pos_;
  }
  return true;
}

bool JsonLineScanner::scan_scalar(ValueType& type) {
  const char c = peek();
  if (c == '"') {
    type = ValueType::String;
    StringScan scan;
    return scan_string(scan);
  }
  if (c == '-' || is_digit(c) || c == 'I') {
    type = ValueType::Number;
    return scan_number();
  }
  if (consume("NaN")) {
    type = ValueType::Number;
    return true;
  }
  if (consume("true") || consume("false")) {
    type = ValueType::Boolean;
    return true;
  }
  if (consume("null")) {
    type = ValueType::Null;
    return true;
  }
  return fail("expected a value (an object, array, string, number, true, false, null, NaN or Infinity)");
}

// At the opening quote of an object key; `matches` says whether it equals `wanted` once
// its escapes are decoded.
bool JsonLineScanner::scan_key(std::string_view wanted, bool& matches) {
  const size_t start = pos_;
  if (!skip_key()) return false;
  const std::string_view raw = s_.substr(start + 1, pos_ - start - 2);
  if (raw.find('\\') == std::string_view::npos) {
    matches = raw == wanted;
    return true;
  }
  key_buffer_.clear();
  StringScan scan{.decoded = &key_buffer_};
  pos_ = start;
  scan_string(scan);
  matches = scan.lone_surrogate_at == std::string_view::npos && key_buffer_ == wanted;
  return true;
}

bool JsonLineScanner::skip_key() {
  if (peek() != '"') return fail("expected a string key (in double quotes)");
  StringScan scan;
  return scan_string(scan);
}

// Any value, its nested objects and arrays included; see NOTE [Scanning without a DOM].
bool JsonLineScanner::skip_value(ValueType& type) {
  std::vector<char> open;  // the closing bracket of each object or array being skipped
  while (true) {
    skip_whitespace();
    const char c = peek();
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      if (open.empty()) type = c == '{' ? ValueType::Object : ValueType::Array;
      ++pos_;
      skip_whitespace();
      if (!consume(std::string_view(&close, 1))) {
        open.push_back(close);
        if (c == '{' && !(skip_key() && expect_colon())) return false;
        continue;
      }
    } else {
      ValueType scalar;
      if (!scan_scalar(scalar)) return false;
      if (open.empty()) type = scalar;
    }
    // A value ended: close the containers it ends, up to the next member or element.
    while (!open.empty()) {
      skip_whitespace();
      if (consume(",")) {
        skip_whitespace();
        if (open.back() == '}' && !(skip_key() && expect_colon())) return false;
        break;
      }
      if (!consume(std::string_view(&open.back(), 1)))
        return fail(open.back() == '}' ? "expected ',' or '}' after an object member"
                                       : "expected ',' or ']' after an array element");
      open.pop_back();
    }
    if (open.empty()) return true;
  }
}

bool JsonLineScanner::text_under(std::string_view key, std::string& text) {
  consume("\xEF\xBB\xBF");
  skip_whitespace();
  if (peek() != '{') {
    const size_t value_start = pos_;
    ValueType type;
    if (!skip_value(type)) return false;
    skip_whitespace();
    if (!at_end()) return fail("unexpected data after the JSON value");
    pos_ = value_start;
    problem_ = fmt::format("expected a JSON object, got {}", described(type));
    return false;
  }
  ++pos_;
  skip_whitespace();
  std::optional<ValueType> found;
  size_t lone_surrogate_at = std::string_view::npos;
  if (!consume("}")) {
    while (true) {
      bool matches;
      if (!scan_key(key, matches) || !expect_colon()) return false;
      skip_whitespace();
      if (matches && peek() == '"') {
        text.clear();
        StringScan scan{.decoded = &text};
        if (!scan_string(scan)) return false;
        found = ValueType::String;
        lone_surrogate_at = scan.lone_surrogate_at;
      } else {
        ValueType type;
        if (!skip_value(type)) return false;
        if (matches) found = type;
      }
      skip_whitespace();
      if (consume("}")) break;
      if (!consume(",")) return fail("expected ',' or '}' after an object member");
      skip_whitespace();
    }
  }
  skip_whitespace();
  if (!at_end()) return fail("unexpected data after the JSON object");
  if (!found) {
    problem_ = fmt::format("no key \"{}\" (give the text's key with --json-key)", key);
  } else if (*found != ValueType::String) {
    problem_ = fmt::format("\"{}\" is {}, expected a string", key, described(*found));
  } else if (lone_surrogate_at != std::string_view::npos) {
    problem_ = fmt::format("\"{}\" holds a lone surrogate escape at byte offset {}: Python's json reads it, but it "
                           "has no UTF-8 form and Megatron's tokenizers fail on it",
                           key, lone_surrogate_at);
  }
  return problem_.empty();
}

}  // namespace

std::string json_line_text(std::string_view line, std::string_view key, std::string& text) {
  JsonLineScanner scanner(line);
  return scanner.text_under(key, text) ? std::string() : scanner.problem();
}

}  // namespace forge
