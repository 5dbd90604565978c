// safetensors: writer -> reader round trips (F32, BF16 rounding, F16 and F64 widening),
// the writer's layout (8-byte aligned header padded with spaces, tensors in the given
// order, no temporary left behind), and every malformed file rejected with the file name
// and the offending tensor or value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <vector>

#include "ckpt/half_float.h"
#include "ckpt/safetensors.h"
#include "core/durable_file.h"
#include "core/error.h"
#include "test_data_temp_dir.h"
#include "expect_error.h"

namespace forge {
namespace {

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A file made of an explicit header length, header text and data bytes.
void write_raw(const std::string& path, uint64_t header_length, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&header_length), 8);
  out << header;
  out << std::string(data_bytes, '\0');
}

void write_raw(const std::string& path, const std::string& header, size_t data_bytes) {
  write_raw(path, header.size(), header, data_bytes);
}

TEST(SafetensorsRoundTrip, F32TensorsMetadataAndLayout) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f};
  std::vector<float> b = {42.0f};
  write_safetensors(path, {{"b.weight", {2, 3}, a.data()}, {"a.scalar", {}, b.data()}, {"empty", {0, 4}, nullptr}},
                    SafetensorsDType::F32, {{"format", "pt"}});
  EXPECT_FALSE(std::filesystem::exists(temporary_path_for(path, ::getpid())));

  std::vector<uint8_t> bytes = read_bytes(path);
  uint64_t header_length;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ(header_length % 8, 0u);
  std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_length));
  EXPECT_EQ(header.rfind("{\"__metadata__\":{\"format\":\"pt\"},\"b.weight\":", 0), 0u) << header;
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}'));
  EXPECT_EQ(bytes.size(), 8 + header_length + 7 * sizeof(float));

  SafetensorsFile file(path);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  ASSERT_EQ(file.entries().size(), 3u);
  const SafetensorsEntry* e = file.find("b.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype, SafetensorsDType::F32);
  EXPECT_EQ(e->shape, (Shape{2, 3}));
  EXPECT_EQ(e->begin, 0u);
  std::vector<float> back(6);
  file.read_as_float(*e, back.data());
  EXPECT_EQ(back, a);
  const SafetensorsEntry* s = file.find("a.scalar");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->shape, Shape{});
  float scalar = 0;
  file.read_as_float(*s, &scalar);
  EXPECT_EQ(scalar, 42.0f);
  EXPECT_EQ(file.find("empty")->numel(), 0);
  EXPECT_EQ(file.find("missing"), nullptr);
}

TEST(SafetensorsRoundTrip, Bf16RoundsToNearestEven) {
  TempDir dir;
  const std::string path = dir.file("b.safetensors");
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // 1 + 2^-8 is halfway between two bf16 values and rounds to the even one (1.0);
  // 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
  std::vector<float> values = {1.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -3.140625f, inf, nan, 1e-40f};
  write_safetensors(path, {{"x", {7}, values.data()}}, SafetensorsDType::BF16, {});
  SafetensorsFile file(path);
  EXPECT_EQ(file.find("x")->dtype, SafetensorsDType::BF16);
  EXPECT_EQ(file.find("x")->end, 14u);
  std::vector<float> back(7);
  file.read_as_float(*file.find("x"), back.data());
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 1.0f);
  EXPECT_EQ(back[2], 1.0f + 1.0f / 64);
  EXPECT_EQ(back[3], -3.140625f);
  EXPECT_EQ(back[4], inf);
  EXPECT_TRUE(std::isnan(back[5]));
  EXPECT_EQ(back[6], bf16_to_float(float_to_bf16(1e-40f)));
}

TEST(HalfFloat, NarrowingToF16RoundsAsPyTorch) {
  // Expected bits from torch.tensor([...], dtype=torch.float32).half().view(torch.int16).
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(1.0f + 1.0f / 2048), 0x3c00);       // a tie rounds to the even mantissa
  EXPECT_EQ(float_to_f16(1.0f + 3.0f / 2048), 0x3c02);       // a tie rounds up to the even one
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);                 // largest finite
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);                 // rounds to infinity
  EXPECT_EQ(float_to_f16(-1e9f), 0xfc00);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)), 0x0400);    // smallest normal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);    // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);    // a tie to even: zero
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -26)), 0x0001);
  EXPECT_EQ(float_to_f16(std::ldexp(1023.5f, -24)), 0x0400); // the top subnormal rounds into the normals
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
  for (float x : {0.1f, -3.14159f, 1234.5678f, 6.1e-5f, 3e-7f})
    EXPECT_EQ(f16_to_float(float_to_f16(f16_to_float(float_to_f16(x)))), f16_to_float(float_to_f16(x))) << x;
}

TEST(SafetensorsRoundTrip, F16AndF64WidenToFloat) {
  TempDir dir;
  const std::string path = dir.file("h.safetensors");
  const uint16_t halves[] = {0x3C00, 0xC000, 0x0001, 0x7C00, 0x3555, 0x8000};
  const double doubles[] = {0.25, -1e10};
  const std::string header =
      R"({"h":{"dtype":"F16","shape":[6],"data_offsets":[0,12]},"d":{"dtype":"F64","shape":[2],"data_offsets":[12,28]}})";
  {
    std::ofstream out(path, std::ios::binary);
    uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header;
    out.write(reinterpret_cast<const char*>(halves), sizeof(halves));
    out.write(reinterpret_cast<const char*>(doubles), sizeof(doubles));
  }
  SafetensorsFile file(path);
  std::vector<float> h(6), d(2);
  file.read_as_float(*file.find("h"), h.data());
  file.read_as_float(*file.find("d"), d.data());
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.0f);
  EXPECT_EQ(h[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(h[3], std::numeric_limits<float>::infinity());
  EXPECT_EQ(h[4], 0.333251953125f);
  EXPECT_TRUE(std::signbit(h[5]) && h[5] == 0.0f);
  EXPECT_EQ(d[0], 0.25f);
  EXPECT_EQ(d[1], -1e10f);
}

TEST(SafetensorsRoundTrip, WriterReplacesAnExistingFileAtomically) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  std::vector<float> one = {1.0f}, two = {2.0f, 3.0f};
  write_safetensors(path, {{"t", {1}, one.data()}}, SafetensorsDType::F32, {});
  write_safetensors(path, {{"t", {2}, two.data()}}, SafetensorsDType::F32, {});
  SafetensorsFile file(path);
  EXPECT_EQ(file.find("t")->shape, Shape{2});
  EXPECT_FALSE(std::filesystem::exists(temporary_path_for(path, ::getpid())));
}

TEST(SafetensorsRoundTrip, NonFloatTensorsAreReadableButNotAsWeights) {
  TempDir dir;
  const std::string path = dir.file("i.safetensors");
  write_raw(path, R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", 16);
  SafetensorsFile file(path);
  std::vector<float> out(2);
  std::string e = error_of([&] { file.read_as_float(*file.find("ids"), out.data()); });
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("'ids' has dtype I64"), std::string::npos) << e;
}

struct MalformedCase {
  const char* name;
  std::function<void(const std::string&)> write;
  const char* expected;  // substring of the error
};

std::vector<MalformedCase> malformed_cases() {
  const std::string one = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  return {
      {"shorter than the length field", [](const std::string& p) { std::ofstream(p) << "abc"; }, "too short"},
      {"header length past the end",
       [=](const std::string& p) { write_raw(p, one.size() + 100, one, 0); }, "runs past the end of the file"},
      {"huge header length", [=](const std::string& p) { write_raw(p, 1ull << 40, one, 8); }, "exceeds the"},
      {"header not JSON", [](const std::string& p) { write_raw(p, "{\"t\": nope}", 0); }, "not valid UTF-8 JSON"},
      {"header a JSON array", [](const std::string& p) { write_raw(p, "[1, 2]", 0); }, "expected an object"},
      {"invalid UTF-8", [](const std::string& p) { write_raw(p, "{\"\xff\xfe\":1}", 0); }, "not valid UTF-8 JSON"},
      {"duplicate tensor",
       [](const std::string& p) {
         write_raw(p,
                   R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                   8);
       },
       "names 't' more than once"},
      {"unknown dtype",
       [](const std::string& p) { write_raw(p, R"({"t":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", 8); },
       "tensor 't': unknown dtype \"F7\""},
      {"negative dimension",
       [](const std::string& p) { write_raw(p, R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8); },
       "not a non-negative integer"},
      {"missing data_offsets",
       [](const std::string& p) { write_raw(p, R"({"t":{"dtype":"F32","shape":[2]}})", 8); }, "has no \"data_offsets\""},
      {"offsets of the wrong size",
       [](const std::string& p) { write_raw(p, R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8); },
       "span 8 bytes, but F32 [3] needs 12"},
      {"end before begin",
       [](const std::string& p) { write_raw(p, R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8); },
       "end before begin"},
      {"offsets past the data section (truncated)",
       [=](const std::string& p) { write_raw(p, one, 5); }, "tensor 't': data_offsets [0, 8] end past the data section"},
      {"overlapping tensors",
       [](const std::string& p) {
         write_raw(p,
                   R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                   12);
       },
       "tensor 'b': data_offsets [4, 12] overlap tensor 'a'"},
      {"gap between tensors",
       [](const std::string& p) {
         write_raw(p,
                   R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                   12);
       },
       "leave bytes [4, 8)"},
      {"trailing bytes", [=](const std::string& p) { write_raw(p, one, 12); }, "4 trailing bytes belong to no tensor"},
      {"metadata not strings",
       [](const std::string& p) { write_raw(p, R"({"__metadata__":{"format":1}})", 0); },
       "__metadata__ entry 'format'"},
      {"shape overflows",
       [](const std::string& p) {
         write_raw(p, R"({"t":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8);
       },
       "too large"},
  };
}

TEST(SafetensorsMalformed, EveryCaseIsRejectedWithTheFileName) {
  TempDir dir;
  for (const MalformedCase& c : malformed_cases()) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.file("bad.safetensors");
    std::filesystem::remove(path);
    c.write(path);
    std::string e = error_of([&] { SafetensorsFile file(path); });
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_NE(e.find(c.expected), std::string::npos) << e;
  }
}

TEST(SafetensorsMalformed, MissingFileNamesThePath) {
  std::string e = error_of([] { SafetensorsFile file("/nonexistent/model.safetensors"); });
  EXPECT_NE(e.find("/nonexistent/model.safetensors"), std::string::npos) << e;
}

}  // namespace
}  // namespace forge
