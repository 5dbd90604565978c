#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/tokenizer_regex.h"

#include <pcre2.h>

#include "core/error.h"
#include "data/utf8.h"

namespace forge {

struct TokenizerRegex::Compiled {
  pcre2_code* code = nullptr;
};

TokenizerRegex::TokenizerRegex(const std::string& pattern, const std::string& file, const std::string& where)
    : compiled_(std::make_unique<Compiled>()) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                  PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error_code, &error_offset,
                                  nullptr);
  if (!compiled_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    FORGE_FAIL("{}: {}: invalid regex '{}' at offset {}: {}", file, where, pattern, error_offset,
               reinterpret_cast<const char*>(message));
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
  while (start <= text.size()) {
    const int rc = pcre2_match(compiled_->code, subject, text.size(), start, 0, data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    FORGE_CHECK(rc >= 0, "pcre2_match failed with code {}", rc);
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    matches.emplace_back(ovector[0], ovector[1]);
    if (ovector[1] > ovector[0]) {
      start = ovector[1];
    } else {
      if (ovector[1] >= text.size()) break;
      start = ovector[1] + utf8::unit_length(text, ovector[1]);
    }
  }
  return matches;
}

}  // namespace forge
