#include "distributed/rank_output.h"

#include <unistd.h>

#include <cerrno>

namespace forge {

void RankOutput::feed(std::string_view bytes) {
  while (!bytes.empty()) {
    const size_t newline = bytes.find('\n');
    if (newline == std::string_view::npos) {
      partial_.append(bytes);
      while (partial_.size() >= kMaxLine) {
        emit(std::string_view(partial_).substr(0, kMaxLine));
        partial_.erase(0, kMaxLine);
      }
      return;
    }
    if (partial_.empty()) {
      emit(bytes.substr(0, newline));
    } else {
      partial_.append(bytes.substr(0, newline));
      emit(partial_);
      partial_.clear();
    }
    bytes.remove_prefix(newline + 1);
  }
}

void RankOutput::flush() {
  if (partial_.empty()) return;
  emit(partial_);
  partial_.clear();
}

void RankOutput::emit(std::string_view line) {
  std::string out;
  out.reserve(prefix_.size() + line.size() + 1);
  out.append(prefix_).append(line).push_back('\n');
  size_t written = 0;
  while (written < out.size()) {
    const ssize_t n = write(fd_, out.data() + written, out.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the reader went away (a closed pipe): the line is lost, the ranks go on
    written += static_cast<size_t>(n);
  }
}

}  // namespace forge
