#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/pcre2_class.h"

#include <pcre2.h>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "core/error.h"
#include "data/utf8.h"

namespace forge {
namespace {

// The code points PCRE2 itself matches with the class `[native]`: `[native]+` run over
// every code point, a block of 64K at a time. See NOTE [Exact classes at native speed].
CodePointSet probe_native_class(const std::string& native) {
  const std::string pattern = "[" + native + "]+";
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  std::unique_ptr<pcre2_code, decltype(&pcre2_code_free)> code(
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                    &error_code, &error_offset, nullptr),
      &pcre2_code_free);
  FORGE_CHECK(code, "PCRE2 does not compile the native class '{}' (error {})", pattern, error_code);
  pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE);
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(code.get(), nullptr), &pcre2_match_data_free);
  FORGE_CHECK(data, "out of memory for regex match data");

  CodePointSet set;
  std::string block;
  for (char32_t block_start = 0; block_start < 0x110000; block_start += 0x10000) {
    block.clear();
    for (char32_t c = block_start; c < block_start + 0x10000; ++c)
      if (c < 0xD800 || c > 0xDFFF) utf8::append(block, c);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(block.data());
    for (size_t start = 0; start < block.size();) {
      const int rc = pcre2_match(code.get(), subject, block.size(), start, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      FORGE_CHECK(rc >= 0, "pcre2_match failed with code {}", rc);
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
      set.add(static_cast<char32_t>(utf8::code_point_at(block, ovector[0])),
              static_cast<char32_t>(utf8::code_point_before(block, ovector[1])));
      start = ovector[1];
    }
  }
  return set;
}

const CodePointSet& native_class(const std::string& native) {
  static std::mutex mutex;
  static std::map<std::string, CodePointSet> probed;
  std::lock_guard lock(mutex);
  auto it = probed.find(native);
  if (it == probed.end()) it = probed.emplace(native, probe_native_class(native)).first;
  return it->second;
}

std::string range_syntax(char32_t first, char32_t last) {
  std::string out = fmt::format("\\x{{{:X}}}", static_cast<uint32_t>(first));
  if (last != first) out += fmt::format("-\\x{{{:X}}}", static_cast<uint32_t>(last));
  return out;
}

// The inside of a class: the ranges of `set` below U+0100 (which PCRE2 turns into a bitmap),
// then `natives`, then the other ranges. PCRE2 tests the items in this order, so Latin-1
// text is decided by the bitmap and other text mostly by the native properties.
std::string class_body(const CodePointSet& set, const std::string& natives) {
  std::string low, high;
  for (const auto& [first, last] : set.ranges()) {
    if (first < 0x100) low += range_syntax(first, std::min<char32_t>(last, 0xFF));
    if (last >= 0x100) high += range_syntax(std::max<char32_t>(first, 0x100), last);
  }
  return low + natives + high;
}

}  // namespace

CodePointSet class_set(const std::vector<ClassItem>& items, bool negated) {
  CodePointSet set;
  for (const auto& item : items) set.add(item.set);
  return negated ? set.complement() : set;
}

std::string pcre2_class(const std::vector<ClassItem>& items, bool negated) {
  CodePointSet wanted, spelled_out, native_set;
  std::string natives;
  for (const auto& item : items) {
    wanted.add(item.set);
    if (item.native.empty()) {
      spelled_out.add(item.set);
    } else {
      native_set.add(native_class(item.native));
      natives += item.native;
    }
  }
  CodePointSet emitted = spelled_out;
  emitted.add(native_set);
  spelled_out.add(wanted.difference(emitted));
  const CodePointSet spurious = emitted.difference(wanted);
  const std::string inside = class_body(spelled_out, natives);
  if (inside.empty()) return negated ? "(?s:.)" : "(?!)";
  // A lone exact native stays an escape: PCRE2 repeats \p{L}+ faster than [\p{L}]+.
  if (spurious.empty() && inside == natives && natives.find('\\', 1) == std::string::npos) {
    std::string escape = natives;
    if (negated) escape[1] = escape[1] == 'p' ? 'P' : 'p';
    return escape;
  }
  if (negated) {
    if (spurious.empty()) return "[^" + inside + "]";
    return "(?:[^" + inside + "]|[" + class_body(spurious, "") + "])";
  }
  if (spurious.empty()) return "[" + inside + "]";
  return "(?:(?![" + class_body(spurious, "") + "])[" + inside + "])";
}

}  // namespace forge
