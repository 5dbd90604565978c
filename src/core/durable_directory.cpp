// AtomicDirectory; see NOTE [Durable files] in core/durable_file.h.
#include "core/durable_directory.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "core/error.h"

namespace forge {
namespace {

std::string system_reason() { return std::strerror(errno); }

// Renames directory `from` to `to`. When `to` is a directory already, the two are
// exchanged in one atomic step (so `to` is never missing) and the old `to` is left at
// `from`; returns whether that happened.
bool rename_replacing_directory(const std::string& from, const std::string& to) {
  std::error_code ignored;
  if (std::filesystem::is_directory(to, ignored)) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) != 0)
      FORGE_FAIL("cannot replace '{}' with '{}': {}", to, from, system_reason());
    return true;
  }
  if (::rename(from.c_str(), to.c_str()) != 0) FORGE_FAIL("cannot rename '{}' to '{}': {}", from, to, system_reason());
  return false;
}

}  // namespace

AtomicDirectory::AtomicDirectory(std::string target, DurableOptions options)
    : AtomicDirectory(target, temporary_path_for(target, ::getpid()), options) {}

AtomicDirectory::AtomicDirectory(std::string target, std::string temporary, DurableOptions options)
    : target_(std::move(target)), temporary_(std::move(temporary)), options_(options) {
  std::error_code ec;
  std::filesystem::remove_all(temporary_, ec);
  if (ec) FORGE_FAIL("cannot remove the leftover '{}': {}", temporary_, ec.message());
  if (::mkdir(temporary_.c_str(), 0755) != 0) FORGE_FAIL("cannot create '{}': {}", temporary_, system_reason());
}

AtomicDirectory::AtomicDirectory(AtomicDirectory&& other) noexcept
    : target_(std::move(other.target_)),
      temporary_(std::move(other.temporary_)),
      options_(other.options_),
      committed_(std::exchange(other.committed_, true)) {}

AtomicDirectory::~AtomicDirectory() {
  std::error_code ignored;
  if (!committed_) std::filesystem::remove_all(temporary_, ignored);
}

void AtomicDirectory::commit() {
  FORGE_CHECK(!committed_, "'{}' committed twice", target_);
  if (options_.sync) fsync_directory(temporary_);
  const bool replaced = rename_replacing_directory(temporary_, target_);
  committed_ = true;
  if (options_.sync) fsync_parent_directory(target_);
  std::error_code ignored;
  if (replaced) std::filesystem::remove_all(temporary_, ignored);  // the target's old version
}

}  // namespace forge
