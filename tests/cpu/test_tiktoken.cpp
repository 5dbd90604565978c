// tiktoken BPE files (Meta's Llama 3 tokenizer.model) on small hand-written files: merges
// by rank, whole pieces that are tokens, Meta's special tokens and their ids (Llama 3 and
// Llama 3.1 names), detection by content, and malformed files, whose errors must name
// file:line. The comparison with tiktoken and Hugging Face tokenizers is
// tests/python/test_tiktoken_vs_hf.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "expect_error.h"
#include "file_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using testing::write_file;

std::string base64(const std::string& bytes) {
  static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t group = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) group |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) group |= static_cast<uint8_t>(bytes[i + 2]);
    out += digits[(group >> 18) & 63];
    out += digits[(group >> 12) & 63];
    out += i + 1 < bytes.size() ? digits[(group >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? digits[group & 63] : '=';
  }
  return out;
}

// Ranks 0-255: the single bytes in byte order; then multi-byte tokens.
const std::vector<std::string> kTokens = {"he", "ll", "hell", "hello", " w", "or", "ld", "xyz"};
constexpr int32_t kRanks = 256 + 8;

std::vector<std::string> token_lines() {
  std::vector<std::string> lines;
  for (int b = 0; b < 256; ++b) lines.push_back(base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b));
  for (size_t i = 0; i < kTokens.size(); ++i) lines.push_back(base64(kTokens[i]) + " " + std::to_string(256 + i));
  return lines;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += line + "\n";
  return text;
}

TEST(Tiktoken, MergesByRankAndWholePieces) {
  TempDir dir;
  write_file(dir.file("tokenizer.model"), joined(token_lines()));
  auto tokenizer = load_tokenizer(dir.file("tokenizer.model"));
  EXPECT_EQ(tokenizer->encode("hello world"), (std::vector<int32_t>{259, 260, 261, 262}));
  EXPECT_EQ(tokenizer->encode("hellohe"), (std::vector<int32_t>{259, 256}));
  EXPECT_EQ(tokenizer->encode("xyz"), std::vector<int32_t>{263}) << "a piece that is a token is that token";
  EXPECT_EQ(tokenizer->encode("xyzx"), (std::vector<int32_t>{'x', 'y', 'z', 'x'}));
  EXPECT_EQ(tokenizer->encode("caf\xc3\xa9\xff"), (std::vector<int32_t>{'c', 'a', 'f', 0xc3, 0xa9, 0xff}));
  EXPECT_EQ(tokenizer->decode({259, 260, 261, 262, 0xff}), "hello world\xff");
  EXPECT_EQ(tokenizer->encode(""), std::vector<int32_t>{});
  EXPECT_THROW(tokenizer->decode({kRanks + 256}), Error);
}

TEST(Tiktoken, Llama3SpecialTokensFollowTheRanks) {
  TempDir dir;
  write_file(dir.file("tokenizer.model"), joined(token_lines()));
  auto tokenizer = load_tokenizer(dir.file(""));
  EXPECT_EQ(tokenizer->vocab_size(), kRanks + 256);
  EXPECT_EQ(tokenizer->bos_id(), kRanks);
  EXPECT_EQ(tokenizer->eos_id(), kRanks + 1);
  const std::string text = "<|begin_of_text|>hello<|eot_id|><|start_header_id|><|reserved_special_token_4|>"
                           "<|reserved_special_token_250|><|python_tag|>";
  const auto ids = tokenizer->encode(text);
  const std::vector<int32_t> specials = {kRanks, 259, kRanks + 9, kRanks + 6, kRanks + 8, kRanks + 255};
  ASSERT_GT(ids.size(), specials.size());
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 6), specials);
  EXPECT_EQ(tokenizer->decode(ids), text) << "<|python_tag|> is plain text for Llama 3";
  EXPECT_EQ(tokenizer->decode({kRanks + 1}), "<|end_of_text|>");
}

TEST(Tiktoken, Llama31NamesWhenParamsJsonSaysScaledRope) {
  TempDir dir;
  write_file(dir.file("tokenizer.model"), joined(token_lines()));
  write_file(dir.file("params.json"), R"({"dim": 4096, "rope_theta": 500000.0, "use_scaled_rope": true})");
  auto tokenizer = load_tokenizer(dir.file("tokenizer.model"));
  EXPECT_EQ(tokenizer->encode("<|finetune_right_pad_id|><|reserved_special_token_2|><|eom_id|><|python_tag|>"
                              "<|reserved_special_token_3|><|reserved_special_token_247|><|eot_id|>"),
            (std::vector<int32_t>{kRanks + 4, kRanks + 5, kRanks + 8, kRanks + 10, kRanks + 11, kRanks + 255,
                                  kRanks + 9}));
  EXPECT_EQ(tokenizer->bos_id(), kRanks);
  EXPECT_EQ(tokenizer->eos_id(), kRanks + 1);

  write_file(dir.file("params.json"), R"({"dim": 4096, "rope_theta": 500000.0})");
  EXPECT_EQ(load_tokenizer(dir.file("tokenizer.model"))->encode("<|reserved_special_token_2|>"),
            std::vector<int32_t>{kRanks + 4});
  write_file(dir.file("params.json"), "{not json");
  expect_error([&] { load_tokenizer(dir.file("tokenizer.model")); },
               {dir.file("params.json"), "not a JSON object", "use_scaled_rope"});
}

TEST(Tiktoken, RanksInAnyLineOrderCrlfAndBlankLines) {
  TempDir dir;
  auto lines = token_lines();
  std::reverse(lines.begin(), lines.end());
  std::string text;
  for (const auto& line : lines) text += line + "\r\n\r\n";
  write_file(dir.file("tokenizer.model"), text);
  EXPECT_EQ(load_tokenizer(dir.file("tokenizer.model"))->encode("hello world"),
            (std::vector<int32_t>{259, 260, 261, 262}));
}

// The file with line `index` (0-based, so on line index + 1) replaced.
std::string with_line(size_t index, const std::string& replacement) {
  auto lines = token_lines();
  lines[index] = replacement;
  return joined(lines);
}

TEST(Tiktoken, MalformedFilesNameFileAndLine) {
  TempDir dir;
  const std::string path = dir.file("tokenizer.model");
  auto expect_file_error = [&](const std::string& content, const std::vector<std::string>& fragments) {
    write_file(path, content);
    expect_error([&] { load_tokenizer(path); }, fragments);
  };
  expect_file_error(with_line(16, "IQ=! 16"), {path + ":17:", "'IQ=!' is not base64", "tiktoken BPE file"});
  expect_file_error(with_line(16, "IQ= 16"), {path + ":17:", "is not base64"});
  expect_file_error(with_line(16, base64("\x10")), {path + ":17:", "expected '<base64 of the token bytes> <rank>'"});
  expect_file_error(with_line(16, base64("\x10") + " 16 extra"), {path + ":17:", "got 'EA== 16 extra'"});
  expect_file_error(with_line(16, base64("\x10") + " -16"), {path + ":17:", "the rank '-16' is not a decimal integer"});
  expect_file_error(with_line(16, base64("\x10") + " 15"), {path + ":17:", "rank 15 again (first on line 16)"});
  expect_file_error(with_line(16, base64("\x0f") + " 16"), {path + ":17:", "again (first on line 16)", "one rank"});
  expect_file_error(with_line(16, base64("\x10") + " 264"), {path + ": rank 16 is missing", "from 0 to 264"});
  expect_file_error(with_line(16, base64("\x10") + " 99999"), {path + ":17:", "rank 99999 is beyond the file's"});
  expect_file_error(with_line(16, base64("new token") + " 16"), {path, "no token for the byte 0x10"});
  expect_file_error("\n\n", {path, "the tokenizer file is empty"});
  write_file(dir.file("words.txt"), "just some words\n");
  expect_error([&] { load_tokenizer(dir.file("words.txt")); }, {dir.file("words.txt"), "neither", "tiktoken BPE"});
}

TEST(Tiktoken, DetectedByContentNotByName) {
  TempDir dir;
  write_file(dir.file("tokenizer.model"), std::string("\x0a\x05hello\x15\x00\x00\x80\x3f", 11));
  expect_error([&] { load_tokenizer(dir.file("tokenizer.model")); }, {"SentencePiece"});
  write_file(dir.file("vocab.tiktoken"), joined(token_lines()));
  EXPECT_EQ(load_tokenizer(dir.file("vocab.tiktoken"))->encode("hello"), std::vector<int32_t>{259});
  write_file(dir.file("broken.model"), "not base64 at all\n" + joined(token_lines()));
  expect_error([&] { load_tokenizer(dir.file("broken.model")); },
               {dir.file("broken.model") + ":1:", "expected '<base64 of the token bytes> <rank>'"});
}

}  // namespace
}  // namespace forge
