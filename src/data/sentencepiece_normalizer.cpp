#include "data/sentencepiece_normalizer.h"

#include "data/utf8.h"

namespace forge {
namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581
constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

SentencePieceNormalizer::SentencePieceNormalizer(const SentencePieceNormalizerSpec& spec,
                                                 bool treat_whitespace_as_suffix,
                                                 const ByteTrie& user_defined_symbols, const std::string& where)
    : user_defined_symbols_(user_defined_symbols),
      add_dummy_prefix_(spec.add_dummy_prefix),
      remove_extra_whitespaces_(spec.remove_extra_whitespaces),
      escape_whitespaces_(spec.escape_whitespaces),
      treat_whitespace_as_suffix_(treat_whitespace_as_suffix) {
  if (!spec.precompiled_charsmap.empty()) charsmap_.emplace(spec.precompiled_charsmap, where + ".precompiled_charsmap");
  for (int byte = 0; byte < 256; ++byte) {
    plain_bytes_[byte] = byte < 0x80 && !user_defined_symbols_.may_start_with(byte) &&
                         !(charsmap_ && charsmap_->may_start_with(byte));
  }
}

std::pair<std::string_view, size_t> SentencePieceNormalizer::normalize_prefix(std::string_view input) const {
  const auto first = static_cast<uint8_t>(input[0]);
  if (user_defined_symbols_.may_start_with(first)) {
    if (const size_t length = user_defined_symbols_.longest_prefix(input)) return {input.substr(0, length), length};
  }
  if (charsmap_ && charsmap_->may_start_with(first)) {
    if (const auto [length, replacement] = charsmap_->longest_match(input); length > 0) return {replacement, length};
  }
  if (utf8::code_point_at(input, 0) < 0) return {kReplacementCharacter, 1};
  const size_t length = utf8::unit_length(input, 0);
  return {input.substr(0, length), length};
}

void SentencePieceNormalizer::append_space(std::string& out) const {
  if (escape_whitespaces_) {
    out += kSpaceSymbol;
  } else {
    out += ' ';
  }
}

void SentencePieceNormalizer::normalize(std::string_view input, std::string& out) const {
  out.clear();
  if (remove_extra_whitespaces_) {
    while (!input.empty()) {
      const auto [normalized, consumed] = normalize_prefix(input);
      if (normalized != " ") break;
      input.remove_prefix(consumed);
    }
  }
  if (input.empty()) return;
  out.reserve(input.size() + input.size() / 2 + kSpaceSymbol.size());
  if (add_dummy_prefix_ && !treat_whitespace_as_suffix_) append_space(out);

  // Whether the last prefix written ended in a space (only tracked with
  // remove_extra_whitespaces, which drops the next prefix's leading spaces then).
  bool after_space = remove_extra_whitespaces_;
  while (!input.empty()) {
    const auto first = static_cast<uint8_t>(input[0]);
    if (plain_bytes_[first]) {  // ASCII characters that no rule or symbol starts with
      if (first == ' ') {
        if (!after_space) append_space(out);
        after_space = remove_extra_whitespaces_;
        input.remove_prefix(1);
        continue;
      }
      size_t run = 1;
      while (run < input.size() && input[run] != ' ' && plain_bytes_[static_cast<uint8_t>(input[run])]) ++run;
      out.append(input.data(), run);
      after_space = false;
      input.remove_prefix(run);
      continue;
    }
    auto [normalized, consumed] = normalize_prefix(input);
    if (after_space) {
      while (!normalized.empty() && normalized.front() == ' ') normalized.remove_prefix(1);
    }
    if (!normalized.empty()) {
      for (char c : normalized) {
        if (c == ' ') {
          append_space(out);
        } else {
          out += c;
        }
      }
      after_space = remove_extra_whitespaces_ && normalized.back() == ' ';
    }
    input.remove_prefix(consumed);
  }

  if (remove_extra_whitespaces_) {
    const std::string_view space = escape_whitespaces_ ? kSpaceSymbol : " ";
    size_t length = out.size();
    while (std::string_view(out.data(), length).ends_with(space)) length -= space.size();
    out.erase(length);
  }
  if (add_dummy_prefix_ && treat_whitespace_as_suffix_) append_space(out);
}

}  // namespace forge
