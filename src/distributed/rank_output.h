// One rank's stdout or stderr as `forge launch` passes it on: whole lines, each prefixed
// "[rank R] ", written with one write() so lines of different ranks never mix mid-line.
// Bytes after the last newline wait for the rest of their line; a line longer than
// kMaxLine is passed on in pieces, and flush() ends a last line that had no newline.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace forge {

class RankOutput {
 public:
  static constexpr size_t kMaxLine = 64 * 1024;

  RankOutput(int rank, int fd) : prefix_("[rank " + std::to_string(rank) + "] "), fd_(fd) {}

  void feed(std::string_view bytes);
  void flush();

 private:
  void emit(std::string_view line);

  std::string prefix_;
  int fd_;  // where the prefixed lines go (the launcher's stdout or stderr)
  std::string partial_;
};

}  // namespace forge
