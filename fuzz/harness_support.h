// What the harnesses of fuzz/ share: a private temporary directory per process (on
// /dev/shm when there is one, so that writing an input costs no disk I/O) and the
// handling of the errors forge's parsers are meant to raise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace forge::fuzz {

// The process's temporary directory, created on first use and removed at exit.
const std::string& temp_dir();

// Writes `bytes` to temp_dir()/name (replacing it) and returns the path.
std::string write_temp_file(const std::string& name, std::string_view bytes);

// Runs `parse`; a forge::Error (a rejected input, with its message) is the expected
// outcome of a bad input and is swallowed, as is a std::filesystem::filesystem_error
// (the system refusing a path; commands report it naming the path, core/filesystem_error.h). Anything else escapes: an exception of
// another type (std::out_of_range, nlohmann::json's, std::bad_alloc) is a bug
// (a message that names no file or key) and aborts the harness, as do sanitizer reports.
void expect_only_forge_errors(const std::function<void()>& parse);

// Splits `data` at the first NUL byte: {before, after} (after empty when there is none).
std::pair<std::string_view, std::string_view> split_at_nul(std::string_view data);

inline std::string_view as_view(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace forge::fuzz
