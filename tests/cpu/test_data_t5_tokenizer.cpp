// The T5 prompt tokenizer (data/t5_prompt_tokenizer.h) on a tokenizer.json
// written by hand, small enough to work its segmentations out on paper:
// per-word Viterbi with the best total score, the first of equal offers kept,
// <unk> for characters no piece starts and runs of them fused, added tokens cut
// out of the raw text, whitespace of every kind splitting words, FluxPipeline's
// shape (</s> after at most max_length - 1 ids, <pad> after it), and the
// refusals (invalid UTF-8, a vocabulary without T5's layout, added tokens
// matched in normalized text, another post-processor). transformers' own ids on
// trained models are compared in
// tests/python/test_t5_tokenizer_vs_transformers.py.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "data/t5_prompt_tokenizer.h"
#include "expect_error.h"
#include "file_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;

json added(int id, const std::string& content, bool normalized = false) {
  return {{"id", id},        {"content", content},       {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", normalized}, {"special", true}};
}

// ids: 0 <pad>, 1 </s>, 2 <unk>, 3 ▁, 4 ▁a, 5 b, 6 ▁ab, 7 c, 8 <extra_id_0>, 9
// ▁x, 10 y, 11 ▁xy
json tokenizer_json() {
  json vocab = json::array();
  for (const auto& [piece, score] : std::vector<std::pair<std::string, double>>{{"<pad>", 0.0},
                                                                                {"</s>", 0.0},
                                                                                {"<unk>", 0.0},
                                                                                {"\u2581", -3.0},
                                                                                {"\u2581a", -1.0},
                                                                                {"b", -2.0},
                                                                                {"\u2581ab", -2.5},
                                                                                {"c", -4.0},
                                                                                {"<extra_id_0>", 0.0},
                                                                                {"\u2581x", -2.0},
                                                                                {"y", -1.0},
                                                                                {"\u2581xy", -3.0}})
    vocab.push_back(json::array({piece, score}));
  json single = json::array();
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  single.push_back({{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}});
  return {
      {"model", {{"type", "Unigram"}, {"unk_id", 2}, {"vocab", vocab}}},
      {"added_tokens", json::array({added(0, "<pad>"), added(1, "</s>"), added(2, "<unk>"), added(8, "<extra_id_0>")})},
      {"normalizer", nullptr},
      {"post_processor", {{"type", "TemplateProcessing"}, {"single", single}}}};
}

TEST(T5PromptTokenizer, SegmentsEachWordByBestScore) {
  TempDir dir;
  testing::write_file(dir.file("tokenizer.json"), tokenizer_json().dump());
  const T5PromptTokenizer t(dir.file("tokenizer.json"));
  EXPECT_EQ(t.vocab_size(), 12);
  EXPECT_EQ(t.encode("ab c"), (Ids{6, 3, 7}));                      // ▁ab (-2.5) beats ▁a b (-3); ▁c is ▁ c
  EXPECT_EQ(t.encode("xy"), (Ids{11}));                             // ▁xy and ▁x y tie at -3: the first
                                                                    // offer (▁xy, from the start) stays
  EXPECT_EQ(t.encode("  ab\t\n ab\u3000c  "), (Ids{6, 6, 3, 7}));   // any Unicode whitespace splits
  EXPECT_EQ(t.encode("a\u2581b"), (Ids{4, 3, 5}));                  // a written "▁" starts a word piece of its own
  EXPECT_EQ(t.encode("zq"), (Ids{3, 2}));                           // unknown characters: one fused <unk>
  EXPECT_EQ(t.encode("zbq"), (Ids{3, 2, 5, 2}));                    // runs split by a known piece stay apart
  EXPECT_EQ(t.encode("yx"), (Ids{3, 10, 2}));                       // no piece starts with "x" but ▁x: <unk>
  EXPECT_EQ(t.encode("a</s>b<extra_id_0>"), (Ids{4, 1, 3, 5, 8}));  // added tokens from the raw text
  EXPECT_EQ(t.encode(""), Ids{});
  EXPECT_EQ(t.encode(" \t "), Ids{});
}

TEST(T5PromptTokenizer, PromptIdsAreFluxPipelines) {
  TempDir dir;
  testing::write_file(dir.file("tokenizer.json"), tokenizer_json().dump());
  const T5PromptTokenizer t(dir.file(""));  // a folder holding tokenizer.json
  EXPECT_EQ(t.prompt_ids("ab c", 6), (Ids{6, 3, 7, 1, 0, 0}));
  EXPECT_EQ(t.prompt_ids("ab c ab c", 3), (Ids{6, 3, 1}));  // truncated, </s> kept last
  EXPECT_EQ(t.prompt_ids("", 2), (Ids{1, 0}));
  EXPECT_EQ(t.prompt_ids("ab", 1), (Ids{1}));
  EXPECT_EQ(t.prompt_ids("ab").size(), 512u);
  expect_error([&] { t.prompt_ids("ab", 0); }, {"max_length must be at least 1"});
}

TEST(T5PromptTokenizer, Refusals) {
  TempDir dir;
  const std::string path = dir.file("tokenizer.json");
  testing::write_file(path, tokenizer_json().dump());
  const T5PromptTokenizer t(path);
  expect_error([&] { t.encode("ok \xff here"); }, {"not valid UTF-8 at byte 3"});
  expect_error([&] { t.prompt_ids("\xe2\x82"); }, {"not valid UTF-8 at byte 0"});

  json j = tokenizer_json();
  j["model"]["vocab"][1][0] = "<s>";
  testing::write_file(path, j.dump());
  expect_error([&] { T5PromptTokenizer{path}; }, {path, "piece 1 is '<s>'", "<pad>, </s>, <unk> as ids 0, 1, 2"});

  j = tokenizer_json();
  j["model"]["type"] = "BPE";
  testing::write_file(path, j.dump());
  expect_error([&] { T5PromptTokenizer{path}; }, {path, "model.type", "\"Unigram\""});

  j = tokenizer_json();
  j["model"]["vocab"][4] = json::array({"\u2581a"});
  testing::write_file(path, j.dump());
  expect_error([&] { T5PromptTokenizer{path}; }, {path, "model.vocab[4]", "[piece, score]"});

  j = tokenizer_json();
  j["added_tokens"].push_back(added(5, "b", true));
  testing::write_file(path, j.dump());
  expect_error([&] { T5PromptTokenizer{path}; }, {path, "added_tokens[4]", "normalized"});

  j = tokenizer_json();
  j["added_tokens"].push_back(added(40, "<x>"));
  testing::write_file(path, j.dump());
  expect_error([&] { T5PromptTokenizer{path}; }, {path, "added_tokens[4].id", "outside the vocabulary"});

  j = tokenizer_json();
  j["post_processor"]["single"].erase(1);
  testing::write_file(path, j.dump());
  expect_error([&] { T5PromptTokenizer{path}; }, {path, "post_processor", "[$A, </s>]"});

  j = tokenizer_json();
  j["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", "not base64!"}};
  testing::write_file(path, j.dump());
  expect_error([&] { T5PromptTokenizer{path}; }, {path, "normalizer.precompiled_charsmap", "base64"});

  expect_error([&] { T5PromptTokenizer{dir.file("empty")}; }, {"empty"});
}

}  // namespace
}  // namespace forge
