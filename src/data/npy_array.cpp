#include "data/npy_array.h"

#include <fmt/ranges.h>

#include <bit>
#include <cstring>
#include <limits>
#include <optional>

#include "core/error.h"

namespace forge {

static_assert(std::endian::native == std::endian::little, "'=' (native) byte order is read as little-endian");

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";

// A cursor over the header text; `base` is the header's byte offset in the file, so that
// errors name absolute offsets.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, size_t base, const std::string& name) : text_(text), base_(base), name_(name) {}

  [[noreturn]] void fail(std::string_view expected) const {
    std::string found = at_end() ? "the end of the header" : fmt::format("'{}'", text_.substr(pos_, 12));
    FORGE_FAIL("{}: .npy header at byte offset {}: expected {}, found {}", name_, base_ + pos_, expected, found);
  }
  size_t offset() const { return base_ + pos_; }
  bool at_end() const { return pos_ >= text_.size(); }
  void skip_space() {
    while (!at_end() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  bool accept(char c) {
    skip_space();
    if (!at_end() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c, std::string_view what) {
    if (!accept(c)) fail(what);
  }
  std::string string_literal() {
    skip_space();
    if (at_end() || (text_[pos_] != '\'' && text_[pos_] != '"')) fail("a quoted string");
    const char quote = text_[pos_++];
    const size_t begin = pos_;
    while (!at_end() && text_[pos_] != quote) {
      if (text_[pos_] == '\\') fail("a string without escapes");
      ++pos_;
    }
    if (at_end()) fail(fmt::format("the closing {} of the string", quote));
    return std::string(text_.substr(begin, pos_++ - begin));
  }
  bool bool_literal() {
    skip_space();
    for (auto [word, value] : {std::pair{std::string_view("True"), true}, std::pair{std::string_view("False"), false}}) {
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        return value;
      }
    }
    fail("True or False");
  }
  int64_t int_literal() {
    skip_space();
    int64_t value = 0;
    const size_t begin = pos_;
    while (!at_end() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      if (value > (std::numeric_limits<int64_t>::max() - 9) / 10) fail("a dimension below 2^63");
      value = value * 10 + (text_[pos_++] - '0');
    }
    if (pos_ == begin) fail("a non-negative integer");
    if (!at_end() && text_[pos_] == 'L') ++pos_;  // Python 2 longs, as numpy still accepts
    return value;
  }
  std::vector<int64_t> shape_tuple() {
    expect('(', "'(' opening the shape tuple");
    std::vector<int64_t> shape;
    while (!accept(')')) {
      shape.push_back(int_literal());
      if (accept(')')) {
        if (shape.size() == 1) fail("a ',' after the only dimension: (n,)");  // (n) is not a tuple
        break;
      }
      expect(',', "',' or ')' in the shape tuple");
    }
    return shape;
  }

 private:
  std::string_view text_;
  size_t pos_ = 0, base_;
  const std::string& name_;
};

void parse_descr(const std::string& descr, NpyHeader& header, const std::string& name, size_t offset,
                 bool allow_objects) {
  if (allow_objects && (descr == "|O" || descr == "|O8")) {
    header.kind = NpyKind::Object;
    header.descr = descr;
    return;
  }
  if (descr.size() >= 2 && descr[1] == 'O')
    FORGE_FAIL("{}: .npy header at byte offset {}: 'descr' is '{}': Python objects, stored pickled: only "
               "data.source govreport_npy reads those (data/npy_records.h)",
               name, offset, descr);
  if (!parse_npy_descr(descr, header))
    FORGE_FAIL("{}: .npy header at byte offset {}: 'descr' is '{}': not an integer or bool dtype forge reads; "
               "expected one of b1, i1, u1, i2, u2, i4, u4, i8, u8 with byte order '<', '>' or '|'",
               name, offset, descr);
}

uint64_t load_unsigned(const uint8_t* p, size_t size, bool big_endian) {
  uint64_t value = 0;
  for (size_t i = 0; i < size; ++i) {
    const size_t byte = big_endian ? i : size - 1 - i;
    value = (value << 8) | p[byte];
  }
  return value;
}

}  // namespace

bool parse_npy_descr(const std::string& descr, NpyHeader& header) {
  if (descr.size() != 3) return false;
  const char order = descr[0], kind = descr[1], width = descr[2];
  if (order != '<' && order != '>' && order != '|' && order != '=') return false;
  if (width != '1' && width != '2' && width != '4' && width != '8') return false;
  const size_t size = static_cast<size_t>(width - '0');
  if (order == '|' && size != 1) return false;
  if (kind == 'b' && size != 1) return false;
  if (kind != 'b' && kind != 'i' && kind != 'u') return false;
  header.kind = kind == 'b' ? NpyKind::Bool : kind == 'i' ? NpyKind::Signed : NpyKind::Unsigned;
  header.item_size = size;
  header.big_endian = order == '>';  // '=' is native: little (static_assert in mapped reads below)
  header.descr = descr;
  return true;
}

bool load_npy_element(const uint8_t* p, const NpyHeader& header, int64_t* out) {
  const uint64_t raw = load_unsigned(p, header.item_size, header.big_endian);
  if (header.kind == NpyKind::Signed) {
    const unsigned shift = static_cast<unsigned>(64 - 8 * header.item_size);
    *out = static_cast<int64_t>(raw << shift) >> shift;  // sign-extend
    return true;
  }
  if (raw > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = static_cast<int64_t>(raw);
  return true;
}

NpyHeader parse_npy_header(std::string_view bytes, const std::string& name, bool allow_objects) {
  NpyHeader header;
  if (bytes.size() < kMagic.size() + 2 || bytes.substr(0, kMagic.size()) != kMagic)
    FORGE_FAIL("{}: byte offset 0: expected the .npy magic \"\\x93NUMPY\" and a version, found {} bytes that are not",
               name, std::min<size_t>(bytes.size(), 8));
  header.major_version = static_cast<uint8_t>(bytes[6]);
  header.minor_version = static_cast<uint8_t>(bytes[7]);
  if (header.minor_version != 0 || header.major_version < 1 || header.major_version > 3)
    FORGE_FAIL("{}: byte offset 6: .npy format version {}.{}: expected 1.0, 2.0 or 3.0", name, header.major_version,
               header.minor_version);
  const size_t length_size = header.major_version == 1 ? 2 : 4;
  const size_t text_offset = 8 + length_size;
  if (bytes.size() < text_offset)
    FORGE_FAIL("{}: byte offset 8: expected the {}-byte header length, found the end of the file", name, length_size);
  const uint64_t text_size = load_unsigned(reinterpret_cast<const uint8_t*>(bytes.data()) + 8, length_size, false);
  if (text_size > bytes.size() - text_offset)
    FORGE_FAIL("{}: byte offset 8: the header length is {} bytes but only {} follow: truncated header", name,
               text_size, bytes.size() - text_offset);
  const std::string_view text = bytes.substr(text_offset, text_size);
  header.data_offset = text_offset + text_size;
  if (text.empty() || text.back() != '\n')
    FORGE_FAIL("{}: byte offset {}: expected the header to end with '\\n'", name, header.data_offset - 1);

  HeaderParser parser(text, text_offset, name);
  parser.expect('{', "'{' opening the header dict");
  std::optional<std::string> descr;
  std::optional<bool> fortran_order;
  std::optional<std::vector<int64_t>> shape;
  size_t descr_offset = 0;
  while (!parser.accept('}')) {
    parser.skip_space();
    const size_t key_offset = parser.offset();
    const std::string key = parser.string_literal();
    parser.expect(':', "':' after the key");
    auto duplicate = [&](bool seen) {
      if (seen) FORGE_FAIL("{}: .npy header at byte offset {}: key '{}' given twice", name, key_offset, key);
    };
    if (key == "descr") {
      duplicate(descr.has_value());
      parser.skip_space();
      descr_offset = parser.offset();
      descr = parser.string_literal();
    } else if (key == "fortran_order") {
      duplicate(fortran_order.has_value());
      fortran_order = parser.bool_literal();
    } else if (key == "shape") {
      duplicate(shape.has_value());
      shape = parser.shape_tuple();
    } else {
      FORGE_FAIL("{}: .npy header at byte offset {}: unknown key '{}': expected only 'descr', 'fortran_order' and "
                 "'shape'",
                 name, key_offset, key);
    }
    if (parser.accept('}')) break;
    parser.expect(',', "',' or '}' after a value");
  }
  parser.skip_space();
  if (!parser.at_end()) parser.fail("only spaces and '\\n' after the header dict");
  if (!descr || !fortran_order || !shape)
    FORGE_FAIL("{}: .npy header at byte offset {}: missing key '{}': expected 'descr', 'fortran_order' and 'shape'",
               name, text_offset, !descr ? "descr" : !fortran_order ? "fortran_order" : "shape");
  parse_descr(*descr, header, name, descr_offset, allow_objects);
  if (*fortran_order)
    FORGE_FAIL("{}: .npy header: 'fortran_order' is True: forge reads C-order arrays only (save "
               "numpy.ascontiguousarray(a))",
               name);
  header.shape = *shape;
  header.count = 1;
  const int64_t item_size = header.kind == NpyKind::Object ? 1 : static_cast<int64_t>(header.item_size);
  for (int64_t dim : header.shape) {
    if (dim != 0 && header.count > std::numeric_limits<int64_t>::max() / item_size / dim)
      FORGE_FAIL("{}: .npy header: shape {} overflows 2^63 bytes", name, fmt::join(header.shape, "x"));
    header.count *= dim;
  }
  if (header.kind == NpyKind::Object) return header;
  const uint64_t data_bytes = static_cast<uint64_t>(header.count) * header.item_size;
  const uint64_t found = bytes.size() - header.data_offset;
  if (found < data_bytes)
    FORGE_FAIL("{}: byte offset {}: shape ({}) of '{}' needs {} bytes of data, the file holds {}: truncated", name,
               header.data_offset, fmt::join(header.shape, ", "), header.descr, data_bytes, found);
  if (found > data_bytes)
    FORGE_FAIL("{}: byte offset {}: {} trailing bytes after the {} bytes of shape ({}) of '{}'", name,
               header.data_offset + data_bytes, found - data_bytes, data_bytes, fmt::join(header.shape, ", "),
               header.descr);
  return header;
}

NpyArray::NpyArray(std::string path) : file_(std::move(path)) {
  header_ = parse_npy_header(
      std::string_view(reinterpret_cast<const char*>(file_.data()), file_.size()), file_.path());
}

void NpyArray::read(int64_t first, int64_t n, int64_t* out) const {
  FORGE_CHECK(first >= 0 && n >= 0 && first <= header_.count - n, "elements [{}, {}) of {} in {}", first, first + n,
              header_.count, path());
  const size_t size = header_.item_size;
  const uint8_t* p = file_.data() + header_.data_offset + static_cast<size_t>(first) * size;
  for (int64_t i = 0; i < n; ++i, p += size) {
    if (!load_npy_element(p, header_, out + i))
      FORGE_FAIL("{}: element {} (byte offset {}) is above the largest value forge reads, 2^63 - 1", path(),
                 first + i, header_.data_offset + static_cast<size_t>(first + i) * size);
  }
}

int64_t NpyArray::at(int64_t index) const {
  int64_t value = 0;
  read(index, 1, &value);
  return value;
}

}  // namespace forge
