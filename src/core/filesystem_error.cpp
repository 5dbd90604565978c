#include "core/filesystem_error.h"

#include <fmt/format.h>

namespace forge {

std::string describe_filesystem_error(const std::filesystem::filesystem_error& error) {
  const std::string reason = error.code().message();
  if (error.path1().empty()) return fmt::format("file system: {}", reason);
  if (error.path2().empty()) return fmt::format("'{}': {}", error.path1().string(), reason);
  return fmt::format("'{}' -> '{}': {}", error.path1().string(), error.path2().string(), reason);
}

}  // namespace forge
