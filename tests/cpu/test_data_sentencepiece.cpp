// SentencePiece tokenizer.model files written field by field with forge's protobuf writer:
// the wire reader, BPE merges by piece score (ties leftmost), user-defined and control
// symbols, byte fallback and unknown runs, unigram Viterbi, decode, the double-array
// trie, and malformed files, whose errors must name the file and the field or byte
// offset. Expected ids are what sentencepiece 0.2.3 gives for the same protos; the
// comparison with sentencepiece on trained models is tests/python/test_sentencepiece_model.py.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "core/protobuf_reader.h"
#include "data/byte_trie.h"
#include "data/tokenizer.h"
#include "expect_error.h"
#include "file_testing.h"
#include "test_data_temp_dir.h"
#include "core/protobuf_wire.h"

namespace forge {
namespace {

enum PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

struct Piece {
  std::string text;
  float score = 0.0f;
  int type = kNormal;
};

struct Model {
  std::vector<Piece> pieces;
  int model_type = 2;  // BPE
  bool byte_fallback = false;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = false;

  std::string serialize() const {
    ProtoWriter model, trainer, normalizer;
    for (const Piece& piece : pieces) {
      ProtoWriter p;
      p.add_bytes(1, piece.text);
      p.add_float(2, piece.score);
      p.add_varint(3, piece.type);
      model.add_bytes(1, p.bytes());
    }
    trainer.add_varint(3, model_type);
    trainer.add_varint(35, byte_fallback);
    normalizer.add_bytes(1, "identity");
    normalizer.add_varint(3, add_dummy_prefix);
    normalizer.add_varint(4, remove_extra_whitespaces);
    model.add_bytes(2, trainer.bytes());
    model.add_bytes(3, normalizer.bytes());
    return model.bytes();
  }
};

// ids 0-12 as in the file comment's reference runs.
Model bpe_model() {
  return Model{{{"<unk>", 0, kUnknown}, {"<s>", 0, kControl}, {"</s>", 0, kControl}, {"\u2581"}, {"a"}, {"b"}, {"c"},
                {"ab", -2}, {"bc", -1}, {"\u2581a", -3}, {"abc", -0.5}, {"<sep>", 0, kUserDefined},
                {"<sepx", 0, kUserDefined}}};
}

Model with_bytes(Model model) {
  for (int byte = 0; byte < 256; ++byte) model.pieces.push_back({fmt::format("<0x{:02X}>", byte), 0, kByte});
  model.byte_fallback = true;
  return model;
}

class SentencePieceTest : public ::testing::Test {
 protected:
  std::unique_ptr<Tokenizer> load(const Model& model, const std::string& name = "tokenizer.model") {
    const std::string path = dir_.file(name);
    testing::write_file(path, model.serialize());
    return load_tokenizer(path);
  }
  std::string write(const std::string& name, const std::string& bytes) {
    testing::write_file(dir_.file(name), bytes);
    return dir_.file(name);
  }
  TempDir dir_;
};

using Ids = std::vector<int32_t>;

TEST(ProtoReader, ReadsFieldsAndNamesWhereTheyBreak) {
  ProtoWriter inner, outer;
  inner.add_varint(1, uint64_t{1} << 40);
  inner.add_float(2, 1.5f);
  outer.add_varint(7, 300);
  outer.add_bytes(4, inner.bytes());
  ProtoReader reader(outer.bytes(), "file: ");
  ProtoField field;
  ASSERT_TRUE(reader.next(field));
  EXPECT_EQ(field.number, 7u);
  EXPECT_EQ(reader.varint(field, "count"), 300u);
  ASSERT_TRUE(reader.next(field));
  ProtoReader nested = reader.message(field, "spec");
  ProtoField value;
  ASSERT_TRUE(nested.next(value));
  EXPECT_EQ(nested.varint(value, "id"), uint64_t{1} << 40);
  ASSERT_TRUE(nested.next(value));
  EXPECT_EQ(nested.float32(value, "score"), 1.5f);
  EXPECT_EQ(error_of([&] { nested.varint(value, "score"); }),
            "file: spec.score (field 2) at byte 12: expected wire type 0 (varint), found 5 (fixed32)");
  EXPECT_FALSE(nested.next(value));
  EXPECT_FALSE(reader.next(field));

  auto read_all = [](std::string_view bytes) {
    ProtoReader r(bytes, "f: ");
    ProtoField f;
    while (r.next(f)) {
    }
  };
  EXPECT_EQ(error_of([&] { read_all("\x08\x80"); }), "f: byte 1: the message ends inside a varint");
  EXPECT_EQ(error_of([&] { read_all(std::string("\x08\x01\x12\x05" "ab", 6)); }),
            "f: byte 2: field 2 needs 5 bytes but the message has 2 left");
  EXPECT_EQ(error_of([&] { read_all("\x0B"); }),
            "f: byte 0: field 1 has wire type 3, which is not a valid protobuf field encoding "
            "(groups are not supported)");
  EXPECT_EQ(error_of([&] { read_all(std::string("\x00", 1)); }), "f: byte 0: invalid field number 0");
}

TEST(ByteTrie, FindsEveryKeyThatPrefixesTheText) {
  std::mt19937 rng(7);
  std::map<std::string, int32_t> keys;
  while (keys.size() < 3000) {
    std::string key(1 + rng() % 6, ' ');
    for (char& c : key) c = static_cast<char>("ab\xe2\x96\x81z\x00\xff"[rng() % 7]);
    keys.emplace(key, static_cast<int32_t>(keys.size()));
  }
  const ByteTrie trie({keys.begin(), keys.end()});
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text(rng() % 9, ' ');
    for (char& c : text) c = static_cast<char>("ab\xe2\x96\x81z\x00\xff"[rng() % 7]);
    std::vector<std::pair<size_t, int32_t>> found, expected;
    trie.for_each_prefix(text, [&](size_t length, int32_t value) { found.emplace_back(length, value); });
    for (size_t length = 1; length <= text.size(); ++length) {
      auto it = keys.find(text.substr(0, length));
      if (it != keys.end()) expected.emplace_back(length, it->second);
    }
    ASSERT_EQ(found, expected) << "text of " << text.size() << " bytes";
    EXPECT_EQ(trie.longest_prefix(text), expected.empty() ? 0 : expected.back().first);
  }
}

TEST_F(SentencePieceTest, BpeMergesTheHighestScoringPieceFirst) {
  const auto tokenizer = load(bpe_model());
  EXPECT_EQ(tokenizer->encode("abc"), (Ids{3, 10}));  // bc (-1) before ab (-2), then abc
  EXPECT_EQ(tokenizer->encode("abcb"), (Ids{3, 10, 5}));
  EXPECT_EQ(tokenizer->encode("bcab"), (Ids{3, 8, 7}));
  EXPECT_EQ(tokenizer->encode("a  b"), (Ids{9, 3, 3, 5}));
  EXPECT_EQ(tokenizer->encode(""), Ids{});
  EXPECT_EQ(tokenizer->vocab_size(), 13);
  EXPECT_EQ(tokenizer->bos_id(), 1);
  EXPECT_EQ(tokenizer->eos_id(), 2);
}

// A SentencePiece model is told by its content (the protobuf's first byte, 0x0A), not by
// the name it was saved under.
TEST_F(SentencePieceTest, ModelIsRecognizedWithoutTheModelExtension) {
  for (const std::string name : {"spm.bin", "tokenizer"}) {
    const auto tokenizer = load(bpe_model(), name);
    EXPECT_EQ(tokenizer->encode("abc"), (Ids{3, 10})) << name;
  }
}

TEST_F(SentencePieceTest, BpeBreaksScoreTiesLeftmost) {
  Model model{{{"<unk>", 0, kUnknown}, {"\u2581"}, {"a"}, {"b"}, {"c"}, {"ab", -1}, {"bc", -1}, {"ca", -1},
               {"abc", -5}}};
  model.add_dummy_prefix = false;
  const auto tokenizer = load(model);
  EXPECT_EQ(tokenizer->encode("abc"), (Ids{8}));
  EXPECT_EQ(tokenizer->encode("bca"), (Ids{6, 2}));
  EXPECT_EQ(tokenizer->encode("cab"), (Ids{7, 3}));
  EXPECT_EQ(tokenizer->encode("abcabc"), (Ids{5, 7, 6}));
  EXPECT_EQ(tokenizer->bos_id(), std::nullopt);
}

TEST_F(SentencePieceTest, UserDefinedSymbolsAreTakenWholeAndControlSymbolsAreText) {
  const auto tokenizer = load(bpe_model());
  EXPECT_EQ(tokenizer->encode("a<sep>b<sepxc"), (Ids{9, 11, 5, 12, 6}));
  EXPECT_EQ(tokenizer->encode("<s>"), (Ids{3, 0}));  // "<", "s", ">" are unknown: one <unk>
  EXPECT_EQ(tokenizer->encode("x\u2603y"), (Ids{3, 0}));
}

TEST_F(SentencePieceTest, ByteFallbackSpellsUnknownCharactersInBytes) {
  const auto tokenizer = load(with_bytes(bpe_model()));
  EXPECT_EQ(tokenizer->encode("x\u2603y"), (Ids{3, 133, 239, 165, 144, 134}));
  EXPECT_EQ(tokenizer->encode("a\nb"), (Ids{9, 23, 5}));
  EXPECT_EQ(tokenizer->decode({3, 133, 239, 165, 144, 134}), "x\u2603y");
}

TEST_F(SentencePieceTest, DecodeAsSentencePiece) {
  const auto tokenizer = load(with_bytes(bpe_model()));
  EXPECT_EQ(tokenizer->decode({1, 3, 4, 2}), "a");
  EXPECT_EQ(tokenizer->decode({3, 4, 3, 5}), "a b");
  EXPECT_EQ(tokenizer->decode({0, 0, 4}), " \u2047  \u2047 a");
  EXPECT_EQ(tokenizer->decode({239, 165, 144, 4}), "\u2603a");
  EXPECT_EQ(tokenizer->decode({268, 4, 239}), "\ufffda\ufffd");
  EXPECT_EQ(tokenizer->decode({9, 5}), "ab");
  EXPECT_EQ(tokenizer->decode({3, 3, 4}), " a");
  expect_error([&] { tokenizer->decode({269 + 13}); }, {"token id 282 is not in the vocab (size 269)"});
}

TEST_F(SentencePieceTest, UnigramPicksTheBestSegmentation) {
  Model model{{{"<unk>", 0, kUnknown}, {"\u2581", -2}, {"a", -3}, {"b", -3}, {"ab", -4}, {"\u2581ab", -6.5},
               {"\u2581a", -3.5}, {"c", -10}, {"<sep>", 0, kUserDefined}}};
  model.model_type = 1;
  const auto tokenizer = load(model);
  EXPECT_EQ(tokenizer->encode("ab"), (Ids{1, 4}));
  EXPECT_EQ(tokenizer->encode("abab"), (Ids{1, 4, 4}));
  EXPECT_EQ(tokenizer->encode("ab c"), (Ids{1, 4, 1, 7}));
  EXPECT_EQ(tokenizer->encode("abxab"), (Ids{1, 4, 0, 4}));
  EXPECT_EQ(tokenizer->encode("a<sep>b"), (Ids{6, 8, 3}));
}

TEST_F(SentencePieceTest, MalformedModelsNameTheFileAndTheField) {
  const std::string good = bpe_model().serialize();
  expect_error([&] { load_tokenizer(write("truncated.model", good.substr(0, good.size() - 3))); },
               {"truncated.model: not a valid SentencePiece model: byte ", ": field 3 needs"});
  expect_error([&] { load_tokenizer(write("cut.model", good.substr(0, 20))); },
               {"cut.model: not a valid SentencePiece model: byte 16: field 1 needs"});

  ProtoWriter wrong_wire_type;
  wrong_wire_type.add_varint(1, 5);
  expect_error([&] { load_tokenizer(write("wire.model", wrong_wire_type.bytes())); },
               {"wire.model: not a valid SentencePiece model: pieces[0] (field 1) at byte 0: expected wire type 2 "
                "(length-delimited), found 0 (varint)"});

  Model model = bpe_model();
  model.pieces[4].type = 9;
  expect_error([&] { load(model, "type.model"); },
               {"type.model: not a valid SentencePiece model: pieces[4].type (field 3) at byte ",
                "unknown piece type 9"});

  model = bpe_model();
  model.model_type = 7;
  expect_error([&] { load(model, "model-type.model"); },
               {"model-type.model", "trainer_spec.model_type (field 3)", "unknown model type 7"});
  model.model_type = 3;
  expect_error([&] { load(model, "word.model"); },
               {"word.model: trainer_spec.model_type is WORD; forge encodes SentencePiece BPE and UNIGRAM models"});

  model = with_bytes(bpe_model());
  model.pieces.resize(model.pieces.size() - 3);
  expect_error([&] { load(model, "bytes.model"); },
               {"bytes.model", "byte_fallback is true but 3 of the 256 byte pieces"});
  model = bpe_model();
  model.pieces.push_back({"<0x41>", 0, kByte});
  expect_error([&] { load(model, "byte-piece.model"); },
               {"byte-piece.model", "pieces[13] '<0x41>': a BYTE piece, but trainer_spec.byte_fallback is false"});

  model = bpe_model();
  model.pieces[0].type = kNormal;
  expect_error([&] { load(model, "no-unk.model"); }, {"no-unk.model", "no piece has type UNKNOWN"});
  model = bpe_model();
  model.pieces[5].text = "a";
  expect_error([&] { load(model, "repeated.model"); },
               {"repeated.model", "pieces[5] 'a': the piece is already defined (pieces[4])"});
  model = bpe_model();
  model.pieces[5].text = "";
  expect_error([&] { load(model, "empty.model"); }, {"empty.model", "pieces[5] '': the piece is empty"});
}

TEST_F(SentencePieceTest, MalformedCharsmapIsNamed) {
  auto with_charsmap = [&](const std::string& charsmap) {
    ProtoWriter normalizer, model;
    normalizer.add_bytes(2, charsmap);
    model.add_bytes(3, normalizer.bytes());
    return bpe_model().serialize() + model.bytes();
  };
  expect_error([&] { load_tokenizer(write("header.model", with_charsmap(std::string("\x10\x00\x00\x00xy", 6)))); },
               {"header.model: normalizer_spec.precompiled_charsmap: the blob (6 bytes) does not hold the trie of 16 "
                "bytes its header announces"});
  // One unit whose offset points far outside the four-unit array.
  std::string units(16, '\0');
  units[1] = '\x7f';
  const std::string offset_model = with_charsmap(std::string("\x10\x00\x00\x00", 4) + units);
  expect_error([&] { load_tokenizer(write("offset.model", offset_model)); },
               {"offset.model: normalizer_spec.precompiled_charsmap: trie unit 0 leads to unit", "outside the trie"});
}

}  // namespace
}  // namespace forge
