// Error handling for every layer: FORGE_CHECK throws forge::Error carrying file:line and a
// formatted message. User-facing validation (configs, data files) throws the same type with
// a message that names the file, key or offset; the CLI prints it and exits non-zero.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace forge {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// A config that does not fit the device: the memory estimate says so before the run, or
// an allocation failed. forge bench records these as "oom" and goes on with a sweep.
class OutOfMemoryError : public Error {
 public:
  explicit OutOfMemoryError(const std::string& message) : Error(message) {}
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace forge

// Internal invariant or argument check. The message is only formatted on failure.
#define FORGE_CHECK(cond, ...)                                                            \
  do {                                                                                    \
    if (!(cond)) ::forge::throw_error(__FILE__, __LINE__, "check failed: " #cond ": " + \
                                                              fmt::format(__VA_ARGS__));  \
  } while (0)

// A user-facing error (bad config, bad file). Thrown without file:line noise.
#define FORGE_FAIL(...) throw ::forge::Error(fmt::format(__VA_ARGS__))
