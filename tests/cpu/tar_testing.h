// Tar archives built byte by byte for the tests of data/tar_archive.h and the webdataset image
// layout: ustar, GNU and pax headers (NOTE [Tar archives]), with any field broken.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>

namespace forge::tar_testing {

inline const std::string kUstarMagic(
    "ustar\0"
    "00",
    8);
inline const std::string kGnuMagic("ustar  \0", 8);

inline void put(std::string& block, size_t at, const std::string& text) {
  std::memcpy(&block[at], text.data(), text.size());
}

// Sets the checksum field from the block's bytes (the field read as spaces).
inline void seal(std::string& block) {
  put(block, 148, "        ");
  unsigned sum = 0;
  for (const char c : block) sum += static_cast<unsigned char>(c);
  put(block, 148, fmt::format("{:06o}", sum) + std::string("\0 ", 2));
}

// A header block: name, size, type flag, magic, ustar prefix, link target.
inline std::string header(const std::string& name, uint64_t size, char type = '0',
                          const std::string& magic = kUstarMagic, const std::string& prefix = "",
                          const std::string& link = "") {
  std::string block(512, '\0');
  put(block, 0, name.substr(0, 100));
  put(block, 100, "0000644");
  put(block, 108, "0001750");
  put(block, 116, "0001750");
  put(block, 124, fmt::format("{:011o}", size));
  put(block, 136, "14712345670");
  block[156] = type;
  put(block, 157, link);
  put(block, 257, magic);
  put(block, 345, prefix);
  seal(block);
  return block;
}

inline std::string padded(std::string data) {
  data.resize((data.size() + 511) / 512 * 512, '\0');
  return data;
}

// A header and its padded data.
inline std::string member(const std::string& name, const std::string& data, char type = '0') {
  return header(name, data.size(), type) + padded(data);
}

// A pax extended header ('x') of `records`, in their order.
inline std::string pax(const std::map<std::string, std::string>& records, char type = 'x') {
  std::string data;
  for (const auto& [key, value] : records) {
    const std::string body = " " + key + "=" + value + "\n";
    size_t length = body.size() + 1;
    while (std::to_string(length).size() + body.size() != length) ++length;
    data += std::to_string(length) + body;
  }
  return header("PaxHeaders/x", data.size(), type) + padded(data);
}

// A GNU long-name header ('L') for the next member.
inline std::string gnu_long_name(const std::string& name) {
  const std::string data = name + '\0';
  return header("././@LongLink", data.size(), 'L', kGnuMagic) + padded(data);
}

inline std::string end_blocks() { return std::string(1024, '\0'); }

}  // namespace forge::tar_testing
