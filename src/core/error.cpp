#include "core/error.h"

namespace forge {

void throw_error(const char* file, int line, const std::string& message) {
  throw Error(fmt::format("{} ({}:{})", message, file, line));
}

}  // namespace forge
