#include "harness_support.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace forge::fuzz {

namespace {

std::string make_temp_dir() {
  std::string base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path().string();
  std::string pattern = base + "/forge-fuzz-XXXXXX";
  if (!mkdtemp(pattern.data())) {
    std::perror("forge fuzz: mkdtemp");
    std::abort();
  }
  return pattern;
}

struct TempDir {
  std::string path = make_temp_dir();
  pid_t owner = getpid();
  ~TempDir() {
    std::error_code ignored;
    if (getpid() == owner) std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace

const std::string& temp_dir() {
  static TempDir dir;
  return dir.path;
}

std::string write_temp_file(const std::string& name, std::string_view bytes) {
  std::string path = temp_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    std::fprintf(stderr, "forge fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
  return path;
}

void expect_only_forge_errors(const std::function<void()>& parse) {
  try {
    parse();
  } catch (const Error&) {
  } catch (const std::filesystem::filesystem_error&) {
    // forge's commands report these as bad input, naming the path (core/filesystem_error.h).
  }
}

std::pair<std::string_view, std::string_view> split_at_nul(std::string_view data) {
  size_t nul = data.find('\0');
  if (nul == std::string_view::npos) return {data, {}};
  return {data.substr(0, nul), data.substr(nul + 1)};
}

}  // namespace forge::fuzz
