// The durable writers' crash behaviour (NOTE [Durable files] in core/durable_file.h), under
// real failures: a write the kernel refuses (RLIMIT_FSIZE), a rename the kernel refuses (a
// target of the wrong kind, which fails as root too), and a writer process SIGKILLed
// before its rename or at a random moment. After each, the target holds the old version
// or the complete new one, never a mixture, and a failure the process survives leaves no
// temporary behind. Every other writer in forge is built on these two, so this is the one
// place that injects failures.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "core/durable_directory.h"
#include "core/durable_file.h"
#include "expect_error.h"
#include "test_data_temp_dir.h"
#include "file_testing.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

// Bytes no other version shares at any offset: a torn file cannot pass for old or new.
std::string pattern(size_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(size, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

using testing::read_file;
using testing::write_file;

std::set<std::string> names_in(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename().string());
  return names;
}

using Files = std::map<std::string, std::string>;  // file name -> contents

// Every file of a directory (no subdirectories) and its contents.
Files read_directory(const std::string& dir) {
  Files files;
  for (const auto& entry : fs::directory_iterator(dir)) files[entry.path().filename().string()] = read_file(entry.path());
  return files;
}

// What a failed comparison prints instead of megabytes of contents: each name, its size
// and a hash of its bytes.
std::map<std::string, std::string> summary(const Files& files) {
  std::map<std::string, std::string> out;
  for (const auto& [name, contents] : files)
    out[name] = std::to_string(contents.size()) + " bytes, hash " + std::to_string(std::hash<std::string>{}(contents));
  return out;
}

void write_directory(const std::string& dir, const Files& files, DurableOptions options) {
  for (const auto& [name, contents] : files) write_file_atomic(dir + "/" + name, contents, options);
}

std::string filename(const std::string& path) { return fs::path(path).filename().string(); }

// Writes past `bytes` into any file fail with EFBIG (SIGXFSZ ignored) while this lives.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    EXPECT_EQ(::getrlimit(RLIMIT_FSIZE, &saved_), 0);
    previous_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    rlimit limited = saved_;
    limited.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0) << std::strerror(errno);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    ::signal(SIGXFSZ, previous_handler_);
  }

 private:
  rlimit saved_{};
  sighandler_t previous_handler_ = SIG_DFL;
};

// A writer in a child process. `work` gets a function that tells the parent it reached a
// point (wait_until_reported returns then); the child exits 0 when `work` returns, 1 when
// it throws, and is otherwise SIGKILLed by the parent.
class ChildWriter {
 public:
  explicit ChildWriter(const std::function<void(const std::function<void()>& report)>& work) {
    EXPECT_EQ(::pipe(pipe_), 0);
    pid_ = ::fork();
    if (pid_ < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      reaped_ = true;  // nothing to kill or wait for: never signal pid -1 (every process)
    }
    if (pid_ == 0) {
      ::close(pipe_[0]);
      try {
        work([this] {
          if (::write(pipe_[1], "r", 1) != 1) ::_exit(2);
        });
      } catch (...) {
        ::_exit(1);
      }
      ::_exit(0);
    }
    ::close(pipe_[1]);
  }
  ~ChildWriter() {
    ::close(pipe_[0]);
    if (!reaped_) kill();
  }

  pid_t pid() const { return pid_; }
  bool wait_until_reported() {
    char c;
    return ::read(pipe_[0], &c, 1) == 1;
  }
  void kill() {
    if (pid_ > 0) ::kill(pid_, SIGKILL);
    wait();
  }
  // The exit status as waitpid reports it.
  int wait() {
    int status = 0;
    if (pid_ > 0) ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return status;
  }

 private:
  int pipe_[2] = {-1, -1};
  pid_t pid_ = -1;
  bool reaped_ = false;
};

[[noreturn]] void wait_to_be_killed() {
  for (;;) ::pause();
}

std::chrono::duration<double> time_to_finish(const std::function<void(const std::function<void()>&)>& work) {
  const auto start = std::chrono::steady_clock::now();
  ChildWriter child(work);
  const int status = child.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the writer failed on its own";
  return std::chrono::steady_clock::now() - start;
}

constexpr size_t kOldSize = 1 << 20, kNewSize = 48 << 20;

TEST(AtomicFile, CreatesAndReplacesTheTargetWhole) {
  TempDir dir;
  const std::string target = dir.file("f.bin");
  std::string previous;
  for (bool sync : {true, false}) {
    const std::string contents = pattern(3000, sync ? 1 : 2);
    AtomicFile file(target, {.sync = sync});
    EXPECT_EQ(file.temporary_path(), temporary_path_for(target, ::getpid()));
    file.write(contents.data(), 1000);
    file.write(contents.data() + 1000, 2000);
    EXPECT_TRUE(read_file(target) == previous) << "the target is untouched until commit";
    file.commit();
    previous = contents;
    EXPECT_TRUE(read_file(target) == contents);
    EXPECT_EQ(names_in(dir.file("")), std::set<std::string>{"f.bin"});
  }
}

TEST(AtomicFile, CommitTwiceAndWriteAfterCommitAreErrors) {
  TempDir dir;
  AtomicFile file(dir.file("f"), {.sync = false});
  file.write("x", 1);
  file.commit();
  expect_error([&] { file.commit(); }, {"committed twice", dir.file("f")});
  expect_error([&] { file.write("y", 1); }, {"after commit", dir.file("f")});
  EXPECT_EQ(read_file(dir.file("f")), "x");
}

TEST(AtomicFile, WriteErrorKeepsTheOldFileAndRemovesTheTemporary) {
  TempDir dir;
  const std::string target = dir.file("f.bin"), old_contents = pattern(4096, 1), new_contents = pattern(1 << 20, 2);
  write_file(target, old_contents);
  {
    FileSizeLimit limit(64 << 10);
    expect_error(
        [&] {
          AtomicFile file(target, {.sync = true});
          file.write(new_contents.data(), new_contents.size());
          file.commit();
        },
        {"failed writing", temporary_path_for(target, ::getpid()), std::strerror(EFBIG)});
  }
  EXPECT_TRUE(read_file(target) == old_contents) << "the old version, byte for byte";
  EXPECT_EQ(names_in(dir.file("")), std::set<std::string>{"f.bin"});
}

// rename(2) of a file over a directory fails with EISDIR, for root as for anyone.
TEST(AtomicFile, RenameErrorKeepsTheTargetAndRemovesTheTemporary) {
  TempDir dir;
  const std::string target = dir.file("taken");
  fs::create_directory(target);
  write_file(target + "/inside", "kept");
  expect_error(
      [&] {
        AtomicFile file(target, {.sync = true});
        file.write("new", 3);
        file.commit();
      },
      {"cannot rename", temporary_path_for(target, ::getpid()), target, std::strerror(EISDIR)});
  EXPECT_EQ(read_directory(target), (Files{{"inside", "kept"}}));
  EXPECT_EQ(names_in(dir.file("")), std::set<std::string>{"taken"});
}

// The writer is killed with every byte of the new version written (and flushed), but
// before commit() renames it: the target keeps the old version, byte for byte.
TEST(AtomicFile, KillBetweenWriteAndRenameKeepsTheOldFile) {
  TempDir dir;
  const std::string target = dir.file("f.bin"), old_contents = pattern(kOldSize, 1), new_contents = pattern(kNewSize, 2);
  write_file_atomic(target, old_contents, {.sync = false});
  ChildWriter child([&](const std::function<void()>& report) {
    AtomicFile file(target, {.sync = true});
    file.write(new_contents.data(), new_contents.size());
    report();
    wait_to_be_killed();
  });
  ASSERT_TRUE(child.wait_until_reported());
  child.kill();
  EXPECT_TRUE(read_file(target) == old_contents) << "the old version, byte for byte";
  const std::string leftover = temporary_path_for(target, child.pid());
  EXPECT_EQ(names_in(dir.file("")), (std::set<std::string>{"f.bin", filename(leftover)}));
  EXPECT_EQ(fs::file_size(leftover), new_contents.size()) << "the child was killed after its write";
}

enum class Version { Neither, Old, New };

// Kills a child running write_new at 16 moments spread over 1.2 times a whole write and
// commit (fixed seed), write_old restoring the old version before each: after each kill
// the target must hold the old or the new version, never a mixture, and nothing but the
// killed writer's own temporary may lie beside it.
void kill_at_random_moments(const TempDir& dir, const std::string& target, const std::function<void()>& write_old,
                            const std::function<void(const std::function<void()>&)>& write_new,
                            const std::function<Version()>& version, unsigned seed) {
  write_old();
  const auto whole_write = time_to_finish(write_new);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> fraction(0.0, 1.2);
  int saw_old = 0, saw_new = 0;
  for (int trial = 0; trial < 16; ++trial) {
    write_old();
    const auto delay = std::chrono::duration_cast<std::chrono::microseconds>(whole_write * fraction(rng));
    SCOPED_TRACE(::testing::Message() << "killed after " << delay.count() << " us of about "
                                      << std::chrono::duration_cast<std::chrono::microseconds>(whole_write).count());
    ChildWriter child(write_new);
    std::this_thread::sleep_for(delay);
    child.kill();
    const Version found = version();
    ASSERT_NE(found, Version::Neither) << "the target holds neither version";
    (found == Version::Old ? saw_old : saw_new) += 1;
    const std::string leftover = temporary_path_for(target, child.pid());
    for (const std::string& name : names_in(dir.file("")))
      EXPECT_TRUE(name == filename(target) || name == filename(leftover)) << name;
    fs::remove_all(leftover);
  }
  ::testing::Test::RecordProperty("kept_old", saw_old);
  ::testing::Test::RecordProperty("became_new", saw_new);
}

TEST(AtomicFile, KillAtARandomMomentLeavesTheOldOrTheNewFile) {
  TempDir dir;
  const std::string target = dir.file("f.bin"), old_contents = pattern(kOldSize, 1), new_contents = pattern(kNewSize, 2);
  kill_at_random_moments(
      dir, target, [&] { write_file_atomic(target, old_contents, {.sync = false}); },
      [&](const std::function<void()>&) {
        AtomicFile file(target, {.sync = false});
        for (size_t offset = 0; offset < new_contents.size(); offset += 1 << 20)
          file.write(new_contents.data() + offset, std::min<size_t>(1 << 20, new_contents.size() - offset));
        file.commit();
      },
      [&] {
        const std::string contents = read_file(target);
        return contents == old_contents ? Version::Old : contents == new_contents ? Version::New : Version::Neither;
      },
      7);
}

const Files& old_directory() {
  static const Files files = {{"a.bin", pattern(kOldSize, 1)}, {"b.json", "{}"}};
  return files;
}

const Files& new_directory() {
  static const Files files = {
      {"a.bin", pattern(kNewSize / 2, 2)}, {"c.bin", pattern(kNewSize / 2, 3)}, {"d.json", "{\"new\": true}"}};
  return files;
}

void make_old_directory(const std::string& target) {
  AtomicDirectory old_version(target, {.sync = false});
  write_directory(old_version.temporary_path(), old_directory(), {.sync = false});
  old_version.commit();
}

TEST(AtomicDirectory, CreatesAndReplacesTheTargetWhole) {
  TempDir dir;
  const std::string target = dir.file("step-1");
  make_old_directory(target);
  EXPECT_EQ(summary(read_directory(target)), summary(old_directory()));
  for (bool sync : {true, false}) {
    const Files& previous = sync ? old_directory() : new_directory();
    const Files next = sync ? new_directory() : Files{{"only", "one file"}};
    AtomicDirectory staging(target, {.sync = sync});
    EXPECT_EQ(staging.temporary_path(), temporary_path_for(target, ::getpid()));
    write_directory(staging.temporary_path(), next, {.sync = sync});
    EXPECT_EQ(summary(read_directory(target)), summary(previous)) << "the target is untouched until commit";
    staging.commit();
    EXPECT_EQ(summary(read_directory(target)), summary(next));
    EXPECT_EQ(names_in(dir.file("")), std::set<std::string>{"step-1"}) << "the old version is deleted";
  }
}

// Checkpoints name their temporary themselves; a killed save's leftover at that name goes.
TEST(AtomicDirectory, TemporaryOfTheCallersNamingReplacesALeftover) {
  TempDir dir;
  const std::string target = dir.file("step-2"), temporary = dir.file(".tmp-step-2-99");
  fs::create_directory(temporary);
  write_file(temporary + "/half", "x");
  AtomicDirectory staging(target, temporary, {.sync = true});
  EXPECT_TRUE(fs::is_empty(temporary));
  write_file_atomic(temporary + "/whole", "y", {.sync = true});
  staging.commit();
  EXPECT_EQ(read_directory(target), (Files{{"whole", "y"}}));
  EXPECT_EQ(names_in(dir.file("")), std::set<std::string>{"step-2"});
}

TEST(AtomicDirectory, CommitTwiceIsAnError) {
  TempDir dir;
  AtomicDirectory staging(dir.file("d"), {.sync = false});
  staging.commit();
  expect_error([&] { staging.commit(); }, {"committed twice", dir.file("d")});
  EXPECT_TRUE(fs::is_directory(dir.file("d")));
}

TEST(AtomicDirectory, MovedFromOwnsNothing) {
  TempDir dir;
  AtomicDirectory first(dir.file("d"), {.sync = false});
  {
    AtomicDirectory second(std::move(first));
    EXPECT_TRUE(fs::is_directory(second.temporary_path()));
  }
  EXPECT_TRUE(fs::is_empty(dir.file(""))) << "the moved-to writer removed the temporary";
}

TEST(AtomicDirectory, WriteErrorKeepsTheOldDirectoryAndRemovesTheTemporary) {
  TempDir dir;
  const std::string target = dir.file("export");
  make_old_directory(target);
  {
    FileSizeLimit limit(64 << 10);
    expect_error(
        [&] {
          AtomicDirectory staging(target, {.sync = true});
          write_directory(staging.temporary_path(), new_directory(), {.sync = true});
          staging.commit();
        },
        {"failed writing", temporary_path_for(target, ::getpid()), std::strerror(EFBIG)});
  }
  EXPECT_EQ(summary(read_directory(target)), summary(old_directory()));
  EXPECT_EQ(names_in(dir.file("")), std::set<std::string>{"export"});
}

// rename(2) of a directory over a file fails with ENOTDIR, for root as for anyone.
TEST(AtomicDirectory, RenameErrorKeepsTheTargetAndRemovesTheTemporary) {
  TempDir dir;
  const std::string target = dir.file("taken");
  write_file(target, "a file");
  expect_error(
      [&] {
        AtomicDirectory staging(target, {.sync = true});
        write_directory(staging.temporary_path(), new_directory(), {.sync = true});
        staging.commit();
      },
      {"cannot rename", temporary_path_for(target, ::getpid()), target, std::strerror(ENOTDIR)});
  EXPECT_EQ(read_file(target), "a file");
  EXPECT_EQ(names_in(dir.file("")), std::set<std::string>{"taken"});
}

TEST(AtomicDirectory, KillBetweenWriteAndRenameKeepsTheOldDirectory) {
  TempDir dir;
  const std::string target = dir.file("step-3");
  make_old_directory(target);
  ChildWriter child([&](const std::function<void()>& report) {
    AtomicDirectory staging(target, {.sync = true});
    write_directory(staging.temporary_path(), new_directory(), {.sync = true});
    report();
    wait_to_be_killed();
  });
  ASSERT_TRUE(child.wait_until_reported());
  child.kill();
  EXPECT_EQ(summary(read_directory(target)), summary(old_directory()));
  const std::string leftover = temporary_path_for(target, child.pid());
  EXPECT_EQ(names_in(dir.file("")), (std::set<std::string>{"step-3", filename(leftover)}));
  EXPECT_EQ(summary(read_directory(leftover)), summary(new_directory())) << "the child was killed after its writes";
}

TEST(AtomicDirectory, KillAtARandomMomentLeavesTheOldOrTheNewDirectory) {
  TempDir dir;
  const std::string target = dir.file("step-4");
  kill_at_random_moments(
      dir, target, [&] { make_old_directory(target); },
      [&](const std::function<void()>&) {
        AtomicDirectory staging(target, {.sync = false});
        write_directory(staging.temporary_path(), new_directory(), {.sync = false});
        staging.commit();
      },
      [&] {
        const Files files = read_directory(target);
        return files == old_directory() ? Version::Old : files == new_directory() ? Version::New : Version::Neither;
      },
      11);
}

}  // namespace
}  // namespace forge
