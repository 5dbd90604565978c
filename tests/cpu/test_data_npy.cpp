// .npy arrays (data/npy_array.h): every supported dtype in both byte orders and every format
// version read back, and each malformation refused with the file, offset and expectation.
// tests/python/test_npy_array.py checks the same against files numpy itself writes.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/govreport_dataset.h"
#include "data/npy_array.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

std::string le_bytes(uint64_t value, size_t size) {
  std::string out;
  for (size_t i = 0; i < size; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
  return out;
}

// A .npy file with `dict` as its header text (padded to 64 bytes as numpy does) and `data`.
std::string npy_file(const std::string& dict, const std::string& data, int major = 1) {
  const size_t length_size = major == 1 ? 2 : 4;
  std::string text = dict;
  while ((10 + (length_size - 2) + text.size() + 1) % 64 != 0) text.push_back(' ');
  text.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(major));
  out.push_back('\0');
  return out + le_bytes(text.size(), length_size) + text + data;
}

std::string elements(const std::vector<int64_t>& values, size_t size, bool big_endian) {
  std::string out;
  for (int64_t v : values) {
    std::string bytes = le_bytes(static_cast<uint64_t>(v), size);
    if (big_endian) bytes = std::string(bytes.rbegin(), bytes.rend());
    out += bytes;
  }
  return out;
}

void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<int64_t> read_all(const NpyArray& array) {
  std::vector<int64_t> out(static_cast<size_t>(array.count()));
  array.read(0, array.count(), out.data());
  return out;
}

void expect_rejected(const std::string& bytes, const std::string& what) {
  try {
    (void)parse_npy_header(bytes, "f.npy");
    FAIL() << "expected an error containing '" << what << "'";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("f.npy"), std::string::npos) << message;
    EXPECT_NE(message.find(what), std::string::npos) << message;
  }
}

TEST(Npy, ReadsEveryDtypeInBothByteOrders) {
  TempDir dir;
  struct Case {
    std::string kind;
    size_t size;
    std::vector<int64_t> values;
  };
  const std::vector<Case> cases = {
      {"b", 1, {0, 1, 1, 0, 1, 0}},
      {"u", 1, {0, 255, 7, 128, 1, 2}},
      {"i", 1, {-128, 127, -1, 0, 5, 6}},
      {"u", 2, {0, 65535, 32000, 1, 2, 3}},
      {"i", 2, {-32768, 32767, -2, 9, 8, 7}},
      {"u", 4, {0, 4294967295, 128256, 32000, 1, 2}},
      {"i", 4, {-2147483648LL, 2147483647, -100, 31999, 0, 1}},
      {"u", 8, {0, INT64_MAX, 1, 2, 3, 4}},
      {"i", 8, {INT64_MIN, INT64_MAX, -100, 1 << 20, 0, -1}},
  };
  for (const Case& c : cases) {
    for (char order : {'<', '>'}) {
      const bool big = order == '>' && c.size > 1;
      const std::string descr = std::string(1, c.size == 1 ? '|' : order) + c.kind + std::to_string(c.size);
      const std::string path = dir.file("a.npy");
      write(path, npy_file("{'descr': '" + descr + "', 'fortran_order': False, 'shape': (2, 3), }",
                           elements(c.values, c.size, big)));
      NpyArray array(path);
      EXPECT_EQ(array.shape(), (std::vector<int64_t>{2, 3})) << descr;
      EXPECT_EQ(read_all(array), c.values) << descr;
      EXPECT_EQ(array.at(5), c.values[5]) << descr;
    }
  }
}

TEST(Npy, VersionsShapesAndLiterals) {
  TempDir dir;
  const std::string path = dir.file("a.npy");
  for (int major : {1, 2, 3}) {
    write(path, npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }", elements({1, 2, 3, 4}, 4, false),
                         major));
    NpyArray array(path);
    EXPECT_EQ(array.header().major_version, major);
    EXPECT_EQ(read_all(array), (std::vector<int64_t>{1, 2, 3, 4}));
  }
  write(path, npy_file("{\"shape\": (), \"fortran_order\": False, \"descr\": \"<i8\"}", elements({42}, 8, false)));
  NpyArray scalar(path);
  EXPECT_TRUE(scalar.shape().empty());
  EXPECT_EQ(scalar.at(0), 42);
  write(path, npy_file("{'descr': '<u2', 'fortran_order': False, 'shape': (0, 5)}", ""));
  EXPECT_EQ(NpyArray(path).count(), 0);
  write(path, npy_file("{'descr':'<u2','fortran_order':False,'shape':(1L,2L)}", elements({3, 4}, 2, false)));
  EXPECT_EQ(read_all(NpyArray(path)), (std::vector<int64_t>{3, 4}));
}

TEST(Npy, RefusesMalformedFiles) {
  const std::string ok = "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }";
  const std::string two = elements({1, 2}, 4, false);
  expect_rejected("", "byte offset 0: expected the .npy magic");
  expect_rejected("PK\x03\x04 not npy at all", "byte offset 0: expected the .npy magic");
  std::string bad_version = npy_file(ok, two);
  bad_version[6] = 4;
  expect_rejected(bad_version, "byte offset 6: .npy format version 4.0");
  expect_rejected(std::string("\x93NUMPY\x01\x00\x05", 9), "byte offset 8: expected the 2-byte header length");
  expect_rejected(npy_file(ok, two).substr(0, 40), "truncated header");
  std::string no_newline = npy_file(ok, two);
  no_newline[no_newline.size() - two.size() - 1] = ' ';
  expect_rejected(no_newline, "expected the header to end with '\\n'");
  expect_rejected(npy_file("['descr', '<i4']", two), "expected '{' opening the header dict, found '['descr'");
  expect_rejected(npy_file("{'descr': '<i4', 'fortran_order': False}", two), "missing key 'shape'");
  expect_rejected(npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), 'x': 1}", two),
                  "unknown key 'x'");
  expect_rejected(npy_file("{'descr': '<i4', 'descr': '<i4', 'fortran_order': False, 'shape': (2,)}", two),
                  "key 'descr' given twice");
  expect_rejected(npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", two),
                  "'descr' is '<f4': not an integer or bool dtype");
  expect_rejected(npy_file("{'descr': '|O', 'fortran_order': False, 'shape': (2,)}", two),
                  "'descr' is '|O': Python objects, stored pickled");
  expect_rejected(npy_file("{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (2,)}", two),
                  "expected a quoted string");
  expect_rejected(npy_file("{'descr': '<i4', 'fortran_order': True, 'shape': (2,)}", two),
                  "'fortran_order' is True: forge reads C-order arrays only");
  expect_rejected(npy_file("{'descr': '<i4', 'fortran_order': 0, 'shape': (2,)}", two), "expected True or False");
  expect_rejected(npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2)}", two),
                  "expected a ',' after the only dimension");
  expect_rejected(npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (-2,)}", two),
                  "expected a non-negative integer");
  expect_rejected(npy_file(ok, two.substr(0, 7)), "needs 8 bytes of data, the file holds 7: truncated");
  expect_rejected(npy_file(ok, two + "x"), "1 trailing bytes after the 8 bytes");
  expect_rejected(npy_file("{'descr': '<i8', 'fortran_order': False, 'shape': (4294967296, 4294967296)}", two),
                  "overflows 2^63 bytes");
  expect_rejected(npy_file(ok + " junk", two), "expected only spaces and '\\n' after the header dict");
}

TEST(Npy, RefusesU64AboveInt64AndNamesTheFile) {
  TempDir dir;
  const std::string path = dir.file("big.npy");
  write(path, npy_file("{'descr': '<u8', 'fortran_order': False, 'shape': (2,)}",
                       elements({1, -1}, 8, false)));
  NpyArray array(path);
  EXPECT_EQ(array.at(0), 1);
  try {
    (void)array.at(1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": element 1"), std::string::npos) << e.what();
  }
  try {
    NpyArray missing(dir.file("missing.npy"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.npy"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge

namespace forge {
namespace {

TEST(GovReportNpy, SplitsAreTheTwoFilesAndTestIsRefused) {
  EXPECT_EQ(govreport_npy_file("/d/gov", Split::Train), "/d/gov/train.npy");
  EXPECT_EQ(govreport_npy_file("/d/gov", Split::Validation), "/d/gov/validation.npy");
  try {
    (void)govreport_npy_file("/d/gov", Split::Test);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no test split"), std::string::npos) << e.what();
  }
}

TEST(GovReportNpy, AnIntegerArrayIsNotARecordFile) {
  TempDir dir;
  const std::string path = dir.file("train.npy");
  write(path, npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (2,)}", elements({1, 2}, 4, false)));
  try {
    GovReportDataset dataset(path, 1, 8, true);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": 'descr' is '<i4': expected '|O'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge
