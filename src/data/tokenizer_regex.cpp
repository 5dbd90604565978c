#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/tokenizer_regex.h"

#include <pcre2.h>

#include <optional>

#include "core/error.h"
#include "data/oniguruma_pattern.h"
#include "data/utf8.h"

namespace forge {

struct TokenizerRegex::Compiled {
  pcre2_code* code = nullptr;
};

TokenizerRegex::TokenizerRegex(const std::string& pattern, const std::string& file, const std::string& where)
    : compiled_(std::make_unique<Compiled>()) {
  const std::string translated = oniguruma_to_pcre2(pattern, file, where);
  std::unique_ptr<pcre2_compile_context, decltype(&pcre2_compile_context_free)> context(
      pcre2_compile_context_create(nullptr), &pcre2_compile_context_free);
  FORGE_CHECK(context, "out of memory for a regex compile context");
  pcre2_set_newline(context.get(), PCRE2_NEWLINE_LF);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                  PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE | PCRE2_MATCH_INVALID_UTF, &error_code,
                                  &error_offset, context.get());
  if (!compiled_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    FORGE_FAIL("{}: {}: invalid regex '{}': {}", file, where, pattern, reinterpret_cast<const char*>(message));
  }
  // JIT is an optimization only: where it is unavailable the interpreter gives the same matches.
  pcre2_jit_compile(compiled_->code, PCRE2_JIT_COMPLETE);
}

TokenizerRegex::~TokenizerRegex() { pcre2_code_free(compiled_->code); }

std::vector<std::pair<size_t, size_t>> TokenizerRegex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(compiled_->code, nullptr), &pcre2_match_data_free);
  FORGE_CHECK(data, "out of memory for regex match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  std::optional<size_t> previous_end;
  while (start <= text.size()) {
    int rc = pcre2_match(compiled_->code, subject, text.size(), start, 0, data.get(), nullptr);
    // The JIT's stack (32 KiB) runs out on a repeated group over a very long piece; the
    // interpreter keeps its backtracking on the heap and finishes the same match.
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(compiled_->code, subject, text.size(), start, PCRE2_NO_JIT, data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    FORGE_CHECK(rc >= 0, "pcre2_match failed with code {}", rc);
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t begin = ovector[0], end = ovector[1];
    if (begin == end) {
      if (begin != previous_end) matches.emplace_back(begin, end);
      previous_end = end;
      if (end >= text.size()) break;
      start = end + utf8::unit_length(text, end);
    } else {
      matches.emplace_back(begin, end);
      previous_end = end;
      start = end;
    }
  }
  return matches;
}

}  // namespace forge
