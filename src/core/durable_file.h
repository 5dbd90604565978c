// Writing a file so that readers only ever see the old contents or the complete new ones.
//
// NOTE [Durable files]
// A file is written under a temporary name beside its target (same directory, so the
// rename below never crosses a file system), optionally flushed to stable storage
// (fsync of the file), renamed over the target in one step, and then (optionally) the
// directory is flushed so the rename itself survives a power loss. A writer destroyed
// before commit() removes its temporary file. A process killed between the write and the
// rename leaves the target untouched and a temporary named `<target>.tmp-<pid>` behind.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace forge {

struct DurableOptions {
  bool sync = true;  // fsync the file before the rename and the directory after it
};

class AtomicFile {
 public:
  explicit AtomicFile(std::string path, DurableOptions options = {});
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t size);
  // Flushes (per the options), closes and renames the temporary over the target.
  void commit();

  const std::string& path() const { return path_; }
  const std::string& temporary_path() const { return temporary_; }

 private:
  std::string path_, temporary_;
  DurableOptions options_;
  int fd_ = -1;
  bool committed_ = false;
};

// `contents` into `path` through an AtomicFile.
void write_file_atomic(const std::string& path, std::string_view contents, DurableOptions options = {});

}  // namespace forge
