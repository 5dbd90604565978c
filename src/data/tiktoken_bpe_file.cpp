// Reading and recognizing tiktoken BPE files; see tiktoken_bpe_file.h.
#include "data/tiktoken_bpe_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string_view>
#include <unordered_map>

#include "core/error.h"
#include "core/input_file.h"

namespace forge {
namespace {

constexpr size_t kSniffBytes = 4096;
constexpr const char* kFormatReminder =
    "a tiktoken BPE file, as Meta ships Llama 3's tokenizer.model, has one '<base64 of the token bytes> <rank>' per "
    "line";

int base64_digit(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

}  // namespace

std::optional<std::string> decode_base64(std::string_view text) {
  if (text.empty() || text.size() % 4 != 0) return std::nullopt;
  size_t padding = 0;
  while (padding < 2 && text[text.size() - 1 - padding] == '=') ++padding;
  std::string bytes;
  bytes.reserve(text.size() / 4 * 3);
  uint32_t bits = 0;
  int bit_count = 0;
  for (char c : text.substr(0, text.size() - padding)) {
    const int digit = base64_digit(c);
    if (digit < 0) return std::nullopt;
    bits = (bits << 6) | static_cast<uint32_t>(digit);
    bit_count += 6;
    if (bit_count >= 8) {
      bit_count -= 8;
      bytes.push_back(static_cast<char>((bits >> bit_count) & 0xFF));
    }
  }
  return bytes;
}

namespace {

// `text` with bytes outside printable ASCII written as \xNN, cut to 80 characters.
std::string printable(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, 80)) {
    const auto byte = static_cast<uint8_t>(c);
    out += byte >= 0x20 && byte < 0x7F ? std::string(1, c) : fmt::format("\\x{:02X}", byte);
  }
  return text.size() > 80 ? out + "..." : out;
}

bool is_blank(char c) { return c == ' ' || c == '\t'; }

struct TiktokenLine {
  std::string bytes;
  int64_t rank = 0;
};

// One non-empty line as '<base64> <rank>', or why it is not.
std::optional<TiktokenLine> parse_line(std::string_view line, std::string& problem) {
  const auto first = std::find_if_not(line.begin(), line.end(), is_blank);
  const auto token_end = std::find_if(first, line.end(), is_blank);
  const auto rank_begin = std::find_if_not(token_end, line.end(), is_blank);
  const auto rank_end = std::find_if(rank_begin, line.end(), is_blank);
  const std::string_view token(first, token_end), rank(rank_begin, rank_end);
  if (token.empty() || rank.empty() || std::find_if_not(rank_end, line.end(), is_blank) != line.end()) {
    problem = fmt::format("expected '<base64 of the token bytes> <rank>', got '{}'", printable(line));
    return std::nullopt;
  }
  TiktokenLine parsed;
  auto bytes = decode_base64(token);
  if (!bytes || bytes->empty()) {
    problem = fmt::format("'{}' is not base64 of a token's bytes (A-Z a-z 0-9 + /, '=' padding to a multiple of 4 "
                          "characters)",
                          printable(token));
    return std::nullopt;
  }
  parsed.bytes = std::move(*bytes);
  if (rank.size() > 10 || !std::all_of(rank.begin(), rank.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoll(std::string(rank)) > INT32_MAX) {
    problem = fmt::format("the rank '{}' is not a decimal integer from 0 to {}", printable(rank), INT32_MAX);
    return std::nullopt;
  }
  parsed.rank = std::stoll(std::string(rank));
  return parsed;
}

// Calls visit(line_number, line) for every line of `text`, "\r\n" endings removed.
template <typename Visit>
void for_each_line(std::string_view text, Visit visit) {
  int64_t number = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(begin, end - begin);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!visit(++number, line)) return;
    begin = end + 1;
  }
}

}  // namespace

bool looks_like_tiktoken_bpe(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::string sample(kSniffBytes, '\0');
  in.read(sample.data(), static_cast<std::streamsize>(sample.size()));
  sample.resize(static_cast<size_t>(in.gcount()));
  const bool text = std::all_of(sample.begin(), sample.end(), [](char c) {
    return c == '\n' || c == '\r' || c == '\t' || (c >= 0x20 && c < 0x7F);
  });
  if (!text) return false;
  if (sample.size() == kSniffBytes) {
    const size_t last_newline = sample.rfind('\n');
    sample.resize(last_newline == std::string::npos ? 0 : last_newline);  // only whole lines
  }
  bool any_token_line = false;
  for_each_line(sample, [&](int64_t, std::string_view line) {
    std::string problem;
    any_token_line = !line.empty() && parse_line(line, problem).has_value();
    return !any_token_line;
  });
  return any_token_line;
}

std::vector<std::string> read_tiktoken_bpe(const std::string& file) {
  const std::string content = read_regular_file(file, "the tokenizer file");
  const auto line_count = static_cast<int64_t>(std::count(content.begin(), content.end(), '\n')) + 1;

  std::vector<std::string> bytes_of_rank;
  std::vector<int64_t> line_of_rank;  // 0 where no line has the rank yet
  std::unordered_map<std::string, int64_t> line_of_token;
  for_each_line(content, [&](int64_t number, std::string_view line) {
    if (line.empty()) return true;
    std::string problem;
    auto parsed = parse_line(line, problem);
    if (!parsed) FORGE_FAIL("{}:{}: {} ({})", file, number, problem, kFormatReminder);
    if (parsed->rank >= line_count)
      FORGE_FAIL("{}:{}: rank {} is beyond the file's {} lines: ranks must run from 0 without gaps, one per line",
                 file, number, parsed->rank, line_count);
    const auto rank = static_cast<size_t>(parsed->rank);
    if (rank >= bytes_of_rank.size()) {
      bytes_of_rank.resize(rank + 1);
      line_of_rank.resize(rank + 1, 0);
    }
    if (line_of_rank[rank] != 0)
      FORGE_FAIL("{}:{}: rank {} again (first on line {}): each rank belongs to one token", file, number, rank,
                 line_of_rank[rank]);
    auto [first_line, inserted] = line_of_token.emplace(parsed->bytes, number);
    if (!inserted)
      FORGE_FAIL("{}:{}: the token '{}' again (first on line {}): each token has one rank", file, number,
                 printable(parsed->bytes), first_line->second);
    line_of_rank[rank] = number;
    bytes_of_rank[rank] = std::move(parsed->bytes);
    return true;
  });
  if (bytes_of_rank.empty()) FORGE_FAIL("{}: holds no tokens ({})", file, kFormatReminder);
  const auto gap = std::find(line_of_rank.begin(), line_of_rank.end(), 0);
  if (gap != line_of_rank.end())
    FORGE_FAIL("{}: rank {} is missing: ranks must run from 0 to {} (the highest rank, on line {}) without gaps", file,
               gap - line_of_rank.begin(), line_of_rank.size() - 1, line_of_rank.back());
  for (int byte = 0; byte < 256; ++byte) {
    if (!line_of_token.contains(std::string(1, static_cast<char>(byte))))
      FORGE_FAIL("{}: no token for the byte 0x{:02X}: a byte-level BPE file has one for each of the 256 bytes", file,
                 byte);
  }
  return bytes_of_rank;
}

}  // namespace forge
