// The POSIX file operations checkpoints need for durability: files written and fsynced
// before they count, directories fsynced after entries appear or move, and a rename that
// replaces an existing directory atomically. Each failure is a forge::Error naming the
// path and the system's reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace forge {

// A file created (truncated) for writing; close() flushes it to stable storage.
class DurableFile {
 public:
  explicit DurableFile(std::string path);
  ~DurableFile();
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;

  void write(const void* data, size_t size);
  // fsync, then close; the file counts as written only after this returns.
  void close();

 private:
  std::string path_;
  int fd_ = -1;
};

void write_file_durable(const std::string& path, const std::string& contents);
void fsync_directory(const std::string& path);

// Renames directory `from` to `to`. When `to` already exists the two are exchanged in one
// atomic step (so `to` is never missing) and the old `to` is left at `from`; returns
// whether that happened.
bool rename_replacing_directory(const std::string& from, const std::string& to);

// Reads `size` bytes at `offset` of an open file into out; false when the file ends first.
class FileReader {
 public:
  explicit FileReader(std::string path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  int64_t size() const { return size_; }
  bool read_at(int64_t offset, void* out, size_t size) const;

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

}  // namespace forge
