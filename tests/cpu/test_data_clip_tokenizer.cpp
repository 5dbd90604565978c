// CLIP's tokenizer pieces: NFC and Lowercase as tokenizers runs them, the BPE end-of-word
// suffix, FluxPipeline's padding and truncation, and the refusals of bad tokenizer folders.
// Token-for-token agreement with transformers is python.test_clip_text_vs_transformers's.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/byte_level.h"
#include "data/clip_tokenizer.h"
#include "data/unicode_normalization.h"
#include "expect_error.h"
#include "file_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::write_file;

std::string nfc_of(std::string s) {
  unicode::nfc(s);
  return s;
}
std::string lower_of(std::string s) {
  unicode::lowercase(s);
  return s;
}

TEST(UnicodeNormalization, NfcComposesReordersAndLeavesInvalidBytes) {
  EXPECT_EQ(nfc_of("cafe\u0301"), "caf\u00e9");
  EXPECT_EQ(nfc_of("\u212b"), "\u00c5");                              // a singleton: Angstrom sign to A-ring
  EXPECT_EQ(nfc_of("\u1e0b\u0323"), "\u1e0d\u0307");                  // d-dot-above + dot-below, reordered
  EXPECT_EQ(nfc_of("q\u0307\u0323"), "q\u0323\u0307");                // no composite: only reordered
  EXPECT_EQ(nfc_of("\u1100\u1161\u11a8"), "\uac01");                  // Hangul L V T
  EXPECT_EQ(nfc_of("\uac00\u11a8"), "\uac01");                        // LV + T
  EXPECT_EQ(nfc_of("\u0344"), "\u0308\u0301");                        // excluded: stays decomposed
  EXPECT_EQ(nfc_of("a\u0300\u0300"), "\u00e0\u0300");                 // the second grave is blocked
  EXPECT_EQ(nfc_of("\u0b47\u0b3e"), "\u0b4b");                        // two starters compose
  EXPECT_EQ(nfc_of("e\xff\u0301"), "e\xff\u0301");                    // an invalid byte blocks
  EXPECT_EQ(nfc_of("plain ascii"), "plain ascii");
}

TEST(UnicodeNormalization, LowercaseMapsEachCodePointAlone) {
  EXPECT_EQ(lower_of("Hello WORLD"), "hello world");
  EXPECT_EQ(lower_of("\u0130"), "i\u0307");                       // I with dot above: two code points
  EXPECT_EQ(lower_of("\u039f\u0394\u03a5\u03a3"), "\u03bf\u03b4\u03c5\u03c3");  // no final sigma
  EXPECT_EQ(lower_of("STRASSE \u1e9e \u00df"), "strasse \u00df \u00df");
  EXPECT_EQ(lower_of("\xc3\x28Z"), "\xc3\x28z");                  // invalid bytes stay
}

// A CLIP tokenizer folder: every byte character with and without "</w>", a few merges,
// the two special tokens last.
struct Folder {
  TempDir dir;
  json vocab = json::object();
  std::vector<std::string> merges = {"h e", "l l", "he ll", "hell o</w>", "c a", "ca t</w>"};

  Folder() {
    std::vector<std::string> characters;
    for (int b = 0; b < 256; ++b) characters.push_back(byte_level::encode(std::string(1, static_cast<char>(b))));
    for (const std::string& c : characters) vocab[c] = vocab.size();
    for (const std::string& c : characters) vocab[c + "</w>"] = vocab.size();
    for (const std::string& m : merges) {
      const size_t space = m.find(' ');
      vocab[m.substr(0, space) + m.substr(space + 1)] = vocab.size();
    }
    vocab["<|startoftext|>"] = vocab.size();
    vocab["<|endoftext|>"] = vocab.size();
    write();
  }
  void write(const std::string& header = "#version: 0.2\n") const {
    write_file(dir.file("vocab.json"), vocab.dump());
    std::string text = header;
    for (const std::string& m : merges) text += m + "\n";
    write_file(dir.file("merges.txt"), text);
  }
  std::string path() const { return fs::path(dir.file("vocab.json")).parent_path().string(); }
  int32_t id(const std::string& token) const { return vocab.at(token).get<int32_t>(); }
};

TEST(ClipTokenizer, EncodesWithEndOfWordSuffixesAndPadsAsFluxPipeline) {
  Folder f;
  const ClipTokenizer tokenizer(f.path());
  const int32_t bos = f.id("<|startoftext|>"), eos = f.id("<|endoftext|>");
  EXPECT_EQ(tokenizer.bos_id(), bos);
  EXPECT_EQ(tokenizer.eos_id(), eos);
  EXPECT_EQ(tokenizer.pad_id(), eos);
  EXPECT_EQ(tokenizer.encode("Hello  CAT"), std::vector<int32_t>({f.id("hello</w>"), f.id("cat</w>")}));
  EXPECT_EQ(tokenizer.encode("cats!"),
            std::vector<int32_t>({f.id("ca"), f.id("t"), f.id("s</w>"), f.id("!</w>")}));
  EXPECT_EQ(tokenizer.encode(""), std::vector<int32_t>());
  EXPECT_EQ(tokenizer.encode_padded("cat", 5), std::vector<int32_t>({bos, f.id("cat</w>"), eos, eos, eos}));
  EXPECT_EQ(tokenizer.encode_padded("cat cat cat cat", 4),
            std::vector<int32_t>({bos, f.id("cat</w>"), f.id("cat</w>"), eos}));  // truncated, the end kept
  EXPECT_EQ(tokenizer.encode_padded("", 2), std::vector<int32_t>({bos, eos}));
  EXPECT_EQ(tokenizer.encode_padded_batch({"cat", "hello cat"}, 4),
            std::vector<int32_t>({bos, f.id("cat</w>"), eos, eos, bos, f.id("hello</w>"), f.id("cat</w>"), eos}));
  expect_error([&] { (void)tokenizer.encode_padded("cat", 1); }, {"length 1"});
}

TEST(ClipTokenizer, FindsTheTokenizerFolderOfAPipeline) {
  Folder f;
  fs::create_directories(f.dir.file("pipeline/tokenizer"));
  for (const char* name : {"vocab.json", "merges.txt"})
    fs::copy_file(f.dir.file(name), f.dir.file(std::string("pipeline/tokenizer/") + name));
  EXPECT_EQ(ClipTokenizer(f.dir.file("pipeline")).encode("cat"), std::vector<int32_t>({f.id("cat</w>")}));
}

TEST(ClipTokenizer, RefusesBadFolders) {
  {
    Folder f;
    f.merges.push_back("c a t");
    f.write();
    expect_error([&] { ClipTokenizer t(f.path()); }, {"merges.txt:8", "two tokens", "c a t"});
  }
  {
    Folder f;
    f.merges.push_back("x y");
    f.write();
    expect_error([&] { ClipTokenizer t(f.path()); }, {"merges.txt:8", "'xy'", "vocab.json lacks"});
  }
  {
    Folder f;
    f.write("#version: 0.2\n\n");
    expect_error([&] { ClipTokenizer t(f.path()); }, {"merges.txt:2", "two tokens"});
  }
  {
    Folder f;
    f.vocab["cat</w>"] = "12";
    f.write();
    expect_error([&] { ClipTokenizer t(f.path()); }, {"vocab.json", "'cat</w>'", "32-bit integer"});
  }
  {
    Folder f;
    write_file(f.dir.file("tokenizer_config.json"), R"({"padding_side": "left"})");
    expect_error([&] { ClipTokenizer t(f.path()); }, {"tokenizer_config.json", "\"padding_side\"", "right"});
  }
  {
    Folder f;
    write_file(f.dir.file("tokenizer_config.json"), R"({"additional_special_tokens": ["<x>"]})");
    expect_error([&] { ClipTokenizer t(f.path()); }, {"tokenizer_config.json", "additional_special_tokens"});
  }
  {
    Folder f;
    write_file(f.dir.file("tokenizer_config.json"), R"({"eos_token": "<|end|>"})");
    expect_error([&] { ClipTokenizer t(f.path()); }, {"tokenizer_config.json", "<|end|>", "not in the vocab"});
  }
  {
    Folder f;
    write_file(f.dir.file("tokenizer_config.json"), R"({"bos_token": {"content": "<|startoftext|>"}})");
    expect_error([&] { ClipTokenizer t(f.path()); }, {"tokenizer_config.json", "\"bos_token\"", "__type"});
  }
  {
    Folder f;
    write_file(f.dir.file("tokenizer_config.json"),
               R"({"added_tokens_decoder": {"5": {"content": "<|endoftext|>", "special": true}}})");
    expect_error([&] { ClipTokenizer t(f.path()); }, {"tokenizer_config.json", "'<|endoftext|>'", "id 5"});
  }
  {
    Folder f;
    write_file(f.dir.file("tokenizer_config.json"), R"({"pad_token": null})");
    expect_error([&] { ClipTokenizer t(f.path()); }, {"\"pad_token\"", "null"});
  }
  {
    Folder f;
    fs::remove(f.dir.file("merges.txt"));
    expect_error([&] { ClipTokenizer t(f.path()); }, {"no merges.txt"});
  }
  TempDir empty;
  expect_error([&] { ClipTokenizer t(fs::path(empty.file("x")).parent_path().string()); },
               {"neither vocab.json", "tokenizer/"});
  expect_error([&] { ClipTokenizer t(empty.file("missing")); }, {"missing", "not a directory"});
}

}  // namespace
}  // namespace forge
