// Whole files in and out, for tests that set up inputs or read back what forge wrote.
#pragma once

#include <fstream>
#include <iterator>
#include <string>

namespace forge::testing {

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_file(const std::string& path, const std::string& contents) {
  std::ofstream(path, std::ios::binary) << contents;
}

}  // namespace forge::testing
