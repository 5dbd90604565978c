// NumPy .npy arrays of integers, read natively and memory-mapped (data/mapped_file.h).
//
// NOTE [The .npy format]
// As numpy.lib.format writes it (format versions 1.0, 2.0, 3.0):
//   bytes 0-5   the magic "\x93NUMPY"
//   bytes 6-7   major, minor version (1.0, 2.0 or 3.0)
//   then        the header length: uint16 little-endian (1.0) or uint32 little-endian (2.0, 3.0)
//   then        the header: a Python literal dict, latin-1 (1.0, 2.0) or UTF-8 (3.0), padded
//               with spaces and ended by '\n', with exactly the keys 'descr' (a dtype string
//               such as '<i4'), 'fortran_order' (True / False) and 'shape' (a tuple of ints)
//   then        the elements, nothing after them.
// forge reads C-order arrays of the integer and bool dtypes (b1, i1, u1, i2, u2, i4, u4, i8,
// u8, either byte order); it refuses Fortran order and every other dtype, notably '|O'
// (Python objects, which numpy stores pickled). Every malformation is an error naming the
// file, the byte offset and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/mapped_file.h"

namespace forge {

enum class NpyKind { Bool, Signed, Unsigned, Object };

struct NpyHeader {
  int major_version = 0, minor_version = 0;
  std::string descr;            // as written, e.g. "<i4"
  NpyKind kind = NpyKind::Signed;
  size_t item_size = 0;         // bytes per element: 1, 2, 4 or 8
  bool big_endian = false;
  std::vector<int64_t> shape;   // empty for a 0-d array
  int64_t count = 1;            // elements: the product of shape
  size_t data_offset = 0;       // where the elements begin
};

// Parses the header of a whole .npy file `bytes` and checks that its size holds exactly
// the elements the header declares. `name` (the path) prefixes every error. With
// allow_objects, descr '|O' is accepted (kind Object, item_size 0, no size check: the
// pickle that follows is data/npy_records.h's to validate).
NpyHeader parse_npy_header(std::string_view bytes, const std::string& name, bool allow_objects = false);

// Fills header.kind, item_size, big_endian and descr from a dtype string ('<i4', '|b1',
// '>u8', ...); false for any dtype forge does not read as integers.
bool parse_npy_descr(const std::string& descr, NpyHeader& header);

// Element `p` of an integer array of `header`'s dtype, as int64; false (and *out
// untouched) for a u8 value above INT64_MAX.
bool load_npy_element(const uint8_t* p, const NpyHeader& header, int64_t* out);

class NpyArray {
 public:
  // Maps `path` and validates it (parse_npy_header); throws a forge::Error naming the path.
  explicit NpyArray(std::string path);

  const std::string& path() const { return file_.path(); }
  const NpyHeader& header() const { return header_; }
  const std::vector<int64_t>& shape() const { return header_.shape; }
  int64_t count() const { return header_.count; }

  // Elements [first, first + n) in C order, converted to int64. A u8 value above
  // INT64_MAX is an error naming the file and the element.
  void read(int64_t first, int64_t n, int64_t* out) const;
  int64_t at(int64_t index) const;

 private:
  MappedFile file_;
  NpyHeader header_;
};

}  // namespace forge
