// Tokenizer loading and encoding on small hand-written tokenizer.json files: the BPE merge
// order, byte fallback, encode_batch against encode, and malformed or unsupported files,
// whose errors must name the file and what is wrong. The comparison with Hugging Face
// tokenizers and sentencepiece is tests/python/test_tokenizer_vs_hf.py.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

// Byte-level BPE over the letters of "hello world" (as GPT-2 characters: "Ġ" is the space).
nlohmann::json byte_level_config() {
  return nlohmann::json::parse(R"({
    "added_tokens": [{"id": 20, "content": "<|end_of_text|>", "single_word": false, "lstrip": false,
                      "rstrip": false, "normalized": false, "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "w": 5, "r": 6, "d": 7,
                                       "he": 8, "ll": 9, "hell": 10, "hello": 11, "Ġw": 12, "or": 13},
              "merges": ["h e", "l l", ["he", "ll"], "hell o", "Ġ w", "o r"]}
  })");
}

std::string write_file(const TempDir& dir, const std::string& name, const std::string& content) {
  const std::string path = dir.file(name);
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

// load_tokenizer must fail with a message that contains each of `parts`.
void expect_load_error(const std::string& path, const std::vector<std::string>& parts) {
  try {
    load_tokenizer(path);
    FAIL() << "loading " << path << " did not fail";
  } catch (const Error& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, ByteLevelBpeMergesByRank) {
  TempDir dir;
  auto tokenizer = load_tokenizer(write_file(dir, "tokenizer.json", byte_level_config().dump()));
  EXPECT_EQ(tokenizer->encode("hello world"), (std::vector<int32_t>{11, 12, 13, 2, 7}));
  EXPECT_EQ(tokenizer->encode("hello<|end_of_text|>"), (std::vector<int32_t>{11, 20}));
  EXPECT_EQ(tokenizer->decode({11, 12, 13, 2, 7, 20}), "hello world<|end_of_text|>");
  EXPECT_EQ(tokenizer->encode(""), std::vector<int32_t>{});
  EXPECT_EQ(tokenizer->vocab_size(), 21);
  EXPECT_EQ(tokenizer->eos_id(), 20);
  EXPECT_FALSE(tokenizer->bos_id().has_value());
  EXPECT_THROW(tokenizer->decode({99}), Error);
}

TEST(Tokenizer, DirectoryWithTokenizerJson) {
  TempDir dir;
  write_file(dir, "tokenizer.json", byte_level_config().dump());
  EXPECT_EQ(load_tokenizer(dir.file(""))->encode("hello"), std::vector<int32_t>{11});
}

TEST(Tokenizer, EncodeBatchEqualsEncode) {
  TempDir dir;
  auto tokenizer = load_tokenizer(write_file(dir, "tokenizer.json", byte_level_config().dump()));
  std::vector<std::string> texts;
  for (int i = 0; i < 500; ++i) {
    std::string text;
    for (int j = 0; j < i % 37; ++j) text += (j % 3 ? "hello " : "world<|end_of_text|>");
    texts.push_back(text + std::to_string(i));
  }
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  const auto batch = tokenizer->encode_batch(views);
  ASSERT_EQ(batch.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(batch[i], tokenizer->encode(texts[i])) << texts[i];
}

TEST(Tokenizer, ByteFallbackAndUnknown) {
  TempDir dir;
  auto config = nlohmann::json::parse(R"({
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                   {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": null,
    "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": true,
              "vocab": {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "▁": 3, "a": 4, "▁a": 5},
              "merges": ["▁ a"]}
  })");
  auto tokenizer = load_tokenizer(write_file(dir, "tokenizer.json", config.dump()));
  EXPECT_EQ(tokenizer->encode("a é"), (std::vector<int32_t>{5, 3, 1, 2}));  // é is bytes C3 A9
  EXPECT_EQ(tokenizer->encode("a\xC3\xB6"), (std::vector<int32_t>{5, 0}));  // ö's byte B6 is not in the vocab
  EXPECT_EQ(tokenizer->decode({5, 3, 1, 2}), "a é");
}

TEST(Tokenizer, MalformedFilesNameTheFileAndTheProblem) {
  TempDir dir;
  expect_load_error(write_file(dir, "not-json.json", "{ this is not json"), {"not-json.json", "not valid JSON"});
  expect_load_error(write_file(dir, "empty.json", ""), {"empty.json", "empty"});
  expect_load_error(write_file(dir, "array.json", "[1, 2]"), {"array.json", "expected a JSON object"});

  auto config = byte_level_config();
  config.erase("model");
  expect_load_error(write_file(dir, "no-model.json", config.dump()), {"no-model.json", "missing 'model'"});

  config = byte_level_config();
  config["model"]["type"] = "WordPiece";
  expect_load_error(write_file(dir, "wordpiece.json", config.dump()),
                    {"wordpiece.json", "model", "type 'WordPiece' is not supported (supported: BPE)"});

  config = byte_level_config();
  config["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_load_error(write_file(dir, "whitespace.json", config.dump()),
                    {"whitespace.json: pre_tokenizer: type 'Whitespace' is not supported (supported: "});

  config = byte_level_config();
  config["normalizer"] = {{"type", "NFKC"}};
  expect_load_error(write_file(dir, "nfkc.json", config.dump()), {"nfkc.json: normalizer: type 'NFKC'"});

  config = byte_level_config();
  config["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "WordPiece"}}}}};
  expect_load_error(write_file(dir, "decoder.json", config.dump()),
                    {"decoder.json: decoder.decoders[0]: type 'WordPiece' is not supported"});

  config = byte_level_config();
  config["model"]["merges"].push_back("h x");
  expect_load_error(write_file(dir, "unknown-merge.json", config.dump()),
                    {"unknown-merge.json", "model.merges[6]", "token 'x' that is not in model.vocab"});

  config = byte_level_config();
  config["model"]["merges"].push_back("e h");
  expect_load_error(write_file(dir, "unmerged.json", config.dump()),
                    {"unmerged.json", "model.merges[6]", "merged token 'eh' is not in model.vocab"});

  config = byte_level_config();
  config["model"]["merges"].push_back("hello");
  expect_load_error(write_file(dir, "bad-merge.json", config.dump()),
                    {"bad-merge.json", "model.merges[6]", "two tokens separated by one space"});

  config = byte_level_config();
  config["model"]["unk_token"] = "<unk>";
  expect_load_error(write_file(dir, "unk.json", config.dump()), {"unk.json", "'<unk>' is not in model.vocab"});

  config = byte_level_config();
  config["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  expect_load_error(write_file(dir, "regex.json", config.dump()), {"regex.json", "pre_tokenizer", "invalid regex"});

  config = byte_level_config();
  config["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}};
  expect_load_error(write_file(dir, "behavior.json", config.dump()), {"behavior.json", "behavior 'Sideways'"});

  config = byte_level_config();
  config["model"]["vocab"]["h"] = "zero";
  expect_load_error(write_file(dir, "vocab.json", config.dump()), {"vocab.json", "model.vocab", "token 'h'"});

  config = byte_level_config();
  config["added_tokens"][0].erase("content");
  expect_load_error(write_file(dir, "added.json", config.dump()), {"added.json", "added_tokens[0]", "'content'"});

  expect_load_error(write_file(dir, "tokenizer.model", "\x0A\x05junk!!"), {"tokenizer.model", "SentencePiece"});
  expect_load_error(write_file(dir, "notes.txt", "plain text"), {"notes.txt", "neither"});
  expect_load_error(dir.file("missing.json"), {"missing.json", "no such"});
  std::filesystem::create_directories(dir.file("empty-dir"));
  expect_load_error(dir.file("empty-dir"), {"empty-dir", "neither tokenizer.json nor tokenizer.model"});
}

}  // namespace
}  // namespace forge
