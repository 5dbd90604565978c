// Writing a file so that readers only ever see the old contents or the complete new ones.
// core/durable_directory.h does the same for a whole directory.
//
// NOTE [Durable files]
// A file is written under a temporary name beside its target, `<target>.tmp-<host>-<pid>`
// (the same directory, so the rename below never crosses a file system; host and pid, so
// no two processes share one, even on two hosts over a shared file system), and commit()
// renames it over the target in one step. A directory is filled the same way under a temporary name
// beside its target and renamed into place whole; an existing target directory is
// exchanged with it in one step (renameat2 RENAME_EXCHANGE), so the target never goes
// missing, and the old version, then at the temporary name, is deleted.
//
// Failures. A writer destroyed before commit() (an error the process survives) removes
// its temporary. A process killed at any moment leaves at the target either the old
// version or the complete new one; killed before the rename, it also leaves its temporary
// behind, named by its host and pid (checkpoint saves clear their folder's leftovers; elsewhere
// they stay until removed by hand). tests/cpu/test_durable_file.cpp injects each of these.
//
// Durability across a crash of the machine is a choice per writer (DurableOptions::sync):
// with it, a file is flushed to stable storage (fsync) before its rename, a directory
// before its rename, and the parent directory after the rename, so the new version
// survives a power loss once commit() returns. Without it, the guarantee above holds for
// a crash of the process but not of the machine. Who syncs:
//   - checkpoints (shard files, metadata.json, the step-<N> directory) sync: a checkpoint
//     is what a run restarts from after a node is lost, and keep_latest_k deletes the older
//     ones right after a save, so an unflushed new one could leave nothing to resume from.
//     Training waits for the disk at each save for that.
//   - no other writer syncs: config.yaml in the run directory, bench.json, perf.csv,
//     preflight.json, forge report's page, safetensors files and Hugging Face exports,
//     prepared datasets. Each is the output of a command that can be run again, and
//     flushing a multi-gigabyte dataset or export would make that command wait for the
//     disk for no reader's benefit. (None of them synced before they shared this writer.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace forge {

struct DurableOptions {
  bool sync = true;  // fsync before the rename and the directory after it; who does: NOTE above
};

// `<target>.tmp-<host>-<pid>`: the temporary name of this host's process `pid`'s writer of `target`.
std::string temporary_path_for(const std::string& target, int64_t pid);

class AtomicFile {
 public:
  // Creates (truncates) the temporary file temporary_path_for(path, this process's pid).
  AtomicFile(std::string path, DurableOptions options);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t size);
  // Flushes (per the options), closes and renames the temporary over the target. Writing or
  // committing again afterwards is an error.
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
void write_file_atomic(const std::string& path, std::string_view contents, DurableOptions options);

// Flushes a directory's entries (files created, renamed or removed in it) to stable storage.
void fsync_directory(const std::string& path);
// fsync_directory of the directory that holds `path` ("." for a bare name).
void fsync_parent_directory(const std::string& path);

}  // namespace forge
