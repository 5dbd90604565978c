// Writing a directory so that readers only ever see the old one or the complete new one:
// it is filled under a temporary name beside its target and renamed into place whole,
// exchanged in one step with a target directory that already exists (NOTE [Durable files]
// in core/durable_file.h).
#pragma once

#include <string>

#include "core/durable_file.h"

namespace forge {

class AtomicDirectory {
 public:
  // Creates the temporary directory temporary_path_for(target, this process's pid).
  AtomicDirectory(std::string target, DurableOptions options);
  // Creates the temporary directory `temporary`, a name of the caller's choosing in the
  // directory that holds `target`. A leftover at that name (a killed process's) is removed
  // first.
  AtomicDirectory(std::string target, std::string temporary, DurableOptions options);
  AtomicDirectory(AtomicDirectory&& other) noexcept;
  // Removes the temporary directory and everything in it, unless committed.
  ~AtomicDirectory();
  AtomicDirectory(const AtomicDirectory&) = delete;
  AtomicDirectory& operator=(const AtomicDirectory&) = delete;
  AtomicDirectory& operator=(AtomicDirectory&&) = delete;

  // Flushes the temporary directory (per the options), renames it to the target (an
  // existing target directory is exchanged with it and then deleted) and flushes the
  // parent (per the options). The entries are their writers' to flush: write them with an
  // AtomicFile of the same options. Committing again afterwards is an error.
  void commit();

  const std::string& path() const { return target_; }
  // Where the entries are written until commit().
  const std::string& temporary_path() const { return temporary_; }

 private:
  std::string target_, temporary_;
  DurableOptions options_;
  bool committed_ = false;
};

}  // namespace forge
