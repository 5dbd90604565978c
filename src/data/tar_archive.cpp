// The tar reader of NOTE [Tar archives].
#include "data/tar_archive.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "core/error.h"

namespace forge {
namespace {

constexpr uint64_t kBlock = 512;
constexpr uint64_t kNone = ~uint64_t{0};

// Header fields: offset and length (POSIX ustar).
constexpr size_t kNameAt = 0, kNameLength = 100;
constexpr size_t kSizeAt = 124, kSizeLength = 12;
constexpr size_t kChecksumAt = 148, kChecksumLength = 8;
constexpr size_t kTypeAt = 156;
constexpr size_t kLinkAt = 157, kLinkLength = 100;
constexpr size_t kMagicAt = 257;
constexpr size_t kPrefixAt = 345, kPrefixLength = 155;

// A field's text up to its first NUL.
std::string_view text_field(std::string_view header, size_t at, size_t length) {
  const std::string_view field = header.substr(at, length);
  return field.substr(0, std::min(field.find('\0'), field.size()));
}

// Bytes as they can be shown in a message: printable ASCII as is, the rest as \xNN.
std::string printable(std::string_view bytes) {
  std::string out;
  for (const char c : bytes) {
    const auto u = static_cast<unsigned char>(c);
    out += (u >= 0x20 && u < 0x7f && u != '\'') ? std::string(1, c) : fmt::format("\\x{:02x}", u);
  }
  return out;
}

bool all_zero(std::string_view block) {
  return std::all_of(block.begin(), block.end(), [](char c) { return c == '\0'; });
}

uint64_t round_up(uint64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

class Indexer {
 public:
  Indexer(std::string_view bytes, const std::string& name) : bytes_(bytes), name_(name) {}

  std::vector<TarMember> run() {
    std::vector<TarMember> members;
    std::optional<std::string> next_path;  // from a pax or GNU long-name header
    std::optional<uint64_t> next_size;     // from a pax header
    uint64_t meta_at = kNone;              // the first of those headers
    uint64_t pos = 0;
    for (;;) {
      if (pos >= bytes_.size())
        fail(bytes_.size(),
             "the file ends here, without the end-of-archive "
             "block (512 zero bytes): truncated?");
      if (bytes_.size() - pos < kBlock)
        fail(pos, fmt::format("a header cut short ({} bytes left, expected 512): truncated?", bytes_.size() - pos));
      const std::string_view header = bytes_.substr(pos, kBlock);
      if (all_zero(header)) {
        if (meta_at != kNone)
          fail(pos, fmt::format("the end-of-archive block right after the "
                                "extended header at byte offset {}, "
                                "expected the member it describes",
                                meta_at));
        break;
      }
      check_checksum(header, pos);
      const char type = header[kTypeAt];
      const bool meta = type == 'x' || type == 'g' || type == 'L';
      uint64_t size = parse_size(header, pos);
      if (!meta && next_size) size = *next_size;
      const std::string path = meta ? std::string() : next_path.value_or(header_path(header));
      const uint64_t data = pos + kBlock;
      const std::string what =
          meta ? fmt::format("the '{}' header", type) : fmt::format("member '{}'", printable(path));
      if (size > bytes_.size() - data)
        fail(pos, fmt::format("{} has {} bytes of data from byte offset {}, "
                              "past the end of the file ({} bytes): "
                              "truncated?",
                              what, size, data, bytes_.size()));
      const uint64_t next = data + round_up(size);
      if (next > bytes_.size())
        fail(pos, fmt::format("{}: the file ends at byte {}, inside the "
                              "padding of its data to 512 bytes "
                              "(expected it to end at {}): truncated?",
                              what, bytes_.size(), next));
      const std::string_view contents = bytes_.substr(data, size);
      switch (type) {
        case 'x': read_pax(contents, pos, next_path, next_size); break;
        case 'g': break;
        case 'L': {
          const std::string_view long_name = contents.substr(0, std::min(contents.find('\0'), contents.size()));
          if (long_name.empty())
            fail(pos,
                 "a GNU long-name header with an empty name, expected the "
                 "next member's");
          next_path = std::string(long_name);
          break;
        }
        case '0':
        case '\0':
        case '7':
          if (path.empty()) fail(pos, "a regular file with an empty name");
          members.push_back({path, meta_at != kNone ? meta_at : pos, data, size});
          break;
        case '5': break;
        default: refuse(header, type, path, pos);
      }
      if (meta) {
        if (meta_at == kNone && type != 'g') meta_at = pos;
      } else {
        next_path.reset();
        next_size.reset();
        meta_at = kNone;
      }
      pos = next;
    }
    return members;
  }

 private:
  [[noreturn]] void fail(uint64_t offset, const std::string& what) const {
    FORGE_FAIL("{}: tar header at byte offset {}: {}", name_, offset, what);
  }

  std::string header_path(std::string_view header) const {
    const std::string_view name = text_field(header, kNameAt, kNameLength);
    // The prefix field exists in POSIX ustar headers only; GNU's use those bytes otherwise.
    if (header.substr(kMagicAt, 6) == std::string_view("ustar\0", 6)) {
      const std::string_view prefix = text_field(header, kPrefixAt, kPrefixLength);
      if (!prefix.empty()) return std::string(prefix) + "/" + std::string(name);
    }
    return std::string(name);
  }

  // An octal number: optional leading spaces, octal digits, then only NULs and spaces.
  std::optional<uint64_t> octal(std::string_view field) const {
    size_t i = 0;
    while (i < field.size() && field[i] == ' ') ++i;
    const size_t first = i;
    uint64_t value = 0;
    for (; i < field.size() && field[i] >= '0' && field[i] <= '7'; ++i) value = value * 8 + (field[i] - '0');
    if (i == first) return std::nullopt;
    for (; i < field.size(); ++i)
      if (field[i] != '\0' && field[i] != ' ') return std::nullopt;
    return value;
  }

  void check_checksum(std::string_view header, uint64_t pos) const {
    const std::string_view field = header.substr(kChecksumAt, kChecksumLength);
    const std::optional<uint64_t> stored = octal(field);
    if (!stored)
      fail(pos, fmt::format("checksum field '{}' is not an octal number: not a "
                            "tar file, or a damaged one",
                            printable(field)));
    int64_t unsigned_sum = 0, signed_sum = 0;
    for (size_t i = 0; i < kBlock; ++i) {
      const bool in_field = i >= kChecksumAt && i < kChecksumAt + kChecksumLength;
      const char c = in_field ? ' ' : header[i];
      unsigned_sum += static_cast<unsigned char>(c);
      signed_sum += static_cast<signed char>(c);
    }
    if (static_cast<int64_t>(*stored) != unsigned_sum && static_cast<int64_t>(*stored) != signed_sum)
      fail(pos, fmt::format("checksum {} (octal {:o}) but the header's bytes "
                            "sum to {} (octal {:o}): not a tar file, "
                            "or a damaged one",
                            *stored, *stored, unsigned_sum, unsigned_sum));
  }

  uint64_t parse_size(std::string_view header, uint64_t pos) const {
    const std::string_view field = header.substr(kSizeAt, kSizeLength);
    const auto first = static_cast<unsigned char>(field[0]);
    if (first & 0x80) {  // GNU base-256: big-endian, the top bit set; 0xff would be negative
      if (first == 0xff) fail(pos, "a negative size (base-256 field), expected a byte count");
      uint64_t value = first & 0x7f;
      for (size_t i = 1; i < field.size(); ++i) {
        if (value >> 56) fail(pos, "a base-256 size beyond 2^64 bytes, expected a byte count");
        value = (value << 8) | static_cast<unsigned char>(field[i]);
      }
      return value;
    }
    const std::optional<uint64_t> value = octal(field);
    if (!value) fail(pos, fmt::format("size field '{}' is not an octal number", printable(field)));
    return *value;
  }

  // Records "LEN key=value\n" (NOTE [Tar archives]).
  void read_pax(std::string_view data, uint64_t pos, std::optional<std::string>& path,
                std::optional<uint64_t>& size) const {
    for (size_t at = 0; at < data.size();) {
      const auto bad = [&](const std::string& why) {
        fail(pos, fmt::format("pax extended header: the record at byte {} of "
                              "its data {}, expected "
                              "'LENGTH key=value\\n'",
                              at, why));
      };
      uint64_t length = 0;
      size_t i = at;
      for (; i < data.size() && data[i] >= '0' && data[i] <= '9' && i - at < 19; ++i)
        length = length * 10 + (data[i] - '0');
      if (i == at || i >= data.size() || data[i] != ' ') bad("does not start with a decimal length and a space");
      if (length < i - at + 3 || length > data.size() - at) bad(fmt::format("has a length of {} bytes", length));
      const std::string_view record = data.substr(at, length);
      if (record.back() != '\n') bad("does not end with a newline");
      const std::string_view pair = record.substr(i - at + 1, record.size() - (i - at + 1) - 1);
      const size_t equals = pair.find('=');
      if (equals == std::string_view::npos || equals == 0) bad("has no key=value");
      const std::string_view key = pair.substr(0, equals), value = pair.substr(equals + 1);
      if (key == "path") {
        if (value.empty()) bad("has an empty path");
        path = std::string(value);
      } else if (key == "size") {
        uint64_t n = 0;
        bool digits = !value.empty() && value.size() <= 19;
        for (const char c : value) {
          digits = digits && c >= '0' && c <= '9';
          n = n * 10 + static_cast<uint64_t>(c - '0');
        }
        if (!digits) bad(fmt::format("has size '{}', not a decimal byte count", printable(value)));
        size = n;
      } else if (key.starts_with("GNU.sparse.")) {
        fail(pos, fmt::format("pax extended header: '{}' describes a GNU "
                              "sparse file, whose data is not the file's "
                              "bytes; expected regular files",
                              printable(key)));
      }
      at += length;
    }
  }

  [[noreturn]] void refuse(std::string_view header, char type, const std::string& path, uint64_t pos) const {
    const std::string target = printable(text_field(header, kLinkAt, kLinkLength));
    const std::string member = printable(path);
    switch (type) {
      case '1':
        fail(pos, fmt::format("member '{}' is a hard link to '{}': links are not "
                              "read; expected regular files",
                              member, target));
      case '2':
        fail(pos, fmt::format("member '{}' is a symbolic link to '{}': links are "
                              "not read; expected regular files",
                              member, target));
      case 'K':
        fail(pos,
             "a GNU long link name (of a link): links are not read; "
             "expected regular files");
      case '3':
      case '4': fail(pos, fmt::format("member '{}' is a device file; expected regular files", member));
      case '6': fail(pos, fmt::format("member '{}' is a FIFO; expected regular files", member));
      case 'S': fail(pos, fmt::format("member '{}' is a GNU sparse file; expected regular files", member));
      case 'V': fail(pos, "a GNU volume header; expected regular files");
      case 'M':
        fail(pos, fmt::format("member '{}' continues from another volume; "
                              "expected regular files",
                              member));
      default:
        fail(pos, fmt::format("member '{}' has type flag '{}', which this reader "
                              "does not know; expected regular "
                              "files ('0'), directories ('5'), pax ('x', 'g') or "
                              "GNU long-name ('L') headers",
                              member, printable(std::string_view(&type, 1))));
    }
  }

  std::string_view bytes_;
  const std::string& name_;
};

}  // namespace

std::vector<TarMember> index_tar(std::string_view bytes, const std::string& name) { return Indexer(bytes, name).run(); }

TarArchive::TarArchive(std::string path) : file_(std::move(path)) {
  members_ = index_tar(bytes(0, file_.size()), file_.path());
}

std::string_view TarArchive::bytes(uint64_t offset, uint64_t size) const {
  FORGE_CHECK(offset <= file_.size() && size <= file_.size() - offset, "{}: bytes {}+{} outside the file's {}",
              file_.path(), offset, size, file_.size());
  if (size == 0) return {};
  return std::string_view(reinterpret_cast<const char*>(file_.data()) + offset, size);
}

}  // namespace forge
