// Megatron indexed datasets: writer -> reader round trip, strict rejection of malformed
// files (each error names the file), split ranges as megatron-core computes them, and
// GPT-style packing.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <vector>

#include "core/error.h"
#include "data/dataset.h"
#include "data/indexed_dataset.h"
#include "data/packed_dataset.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

std::vector<std::vector<int32_t>> write_documents(const std::string& prefix, IndexedDType dtype, int count,
                                                  int first_length) {
  std::vector<std::vector<int32_t>> documents;
  IndexedDatasetWriter writer(prefix, dtype);
  for (int d = 0; d < count; ++d) {
    std::vector<int32_t> tokens(static_cast<size_t>(first_length + d % 5));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((d * 37 + i * 11) % 120);
    writer.add_document(tokens);
    documents.push_back(tokens);
  }
  writer.finalize();
  return documents;
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

template <typename T> void poke(std::vector<uint8_t>& bytes, size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

// Expects opening `prefix` to fail with a message naming `file` and containing `what`.
void expect_rejected(const std::string& prefix, const std::string& file, const std::string& what) {
  try {
    IndexedDataset dataset(prefix);
    FAIL() << "expected an error containing '" << what << "'";
  } catch (const Error& e) {
    std::string message = e.what();
    EXPECT_NE(message.find(file), std::string::npos) << message;
    EXPECT_NE(message.find(what), std::string::npos) << message;
  }
}

TEST(DataIndexed, WriterReaderRoundTrip) {
  TempDir dir;
  for (IndexedDType dtype : {IndexedDType::U8, IndexedDType::U16, IndexedDType::I32, IndexedDType::I64}) {
    std::string prefix = dir.file(std::string(indexed_dtype_name(dtype)));
    auto documents = write_documents(prefix, dtype, 9, 3);
    IndexedDataset dataset(prefix);
    EXPECT_EQ(dataset.dtype(), dtype);
    ASSERT_EQ(dataset.num_sequences(), 9);
    EXPECT_EQ(dataset.num_documents(), 9);
    int64_t pointer = 0;
    for (int64_t s = 0; s < 9; ++s) {
      EXPECT_EQ(dataset.document_index(s), s);
      EXPECT_EQ(dataset.sequence_pointer(s), pointer);
      ASSERT_EQ(dataset.sequence_length(s), static_cast<int64_t>(documents[s].size()));
      std::vector<int32_t> tokens(documents[s].size());
      dataset.read_tokens(s, 0, dataset.sequence_length(s), 120, tokens.data());
      EXPECT_EQ(tokens, documents[s]);
      pointer += dataset.sequence_length(s) * static_cast<int64_t>(indexed_dtype_size(dtype));
    }
    EXPECT_EQ(dataset.document_index(9), 9);
  }
}

TEST(DataIndexed, MultiSequenceDocuments) {
  TempDir dir;
  std::string prefix = dir.file("docs");
  IndexedDatasetWriter writer(prefix, IndexedDType::U16);
  std::vector<int32_t> a = {1, 2}, b = {3}, c = {4, 5, 6};
  writer.add_sequence(a);
  writer.add_sequence(b);
  writer.end_document();
  writer.add_sequence(c);
  writer.finalize();
  IndexedDataset dataset(prefix);
  EXPECT_EQ(dataset.num_sequences(), 3);
  EXPECT_EQ(dataset.num_documents(), 2);
  EXPECT_EQ(dataset.document_index(1), 2);
  EXPECT_EQ(dataset.document_index(2), 3);
  EXPECT_EQ(dataset.token(2, 1), 5);
}

TEST(DataIndexed, WriterRejectsTokensOutsideTheDType) {
  TempDir dir;
  IndexedDatasetWriter writer(dir.file("small"), IndexedDType::U8);
  std::vector<int32_t> tokens = {1, 300};
  EXPECT_THROW(writer.add_document(tokens), Error);
}

// NOTE [Atomic dataset output]: when the new .bin cannot be put in place (here a
// directory stands at <prefix>.bin), the previous .idx is still there afterwards, byte for
// byte, and nothing is left beside the dataset.
TEST(DataIndexed, FailedPromotionKeepsThePreviousIndex) {
  TempDir dir;
  const std::string prefix = dir.file("corpus");
  std::filesystem::create_directories(prefix + ".bin/in-the-way");
  { std::ofstream(prefix + ".idx", std::ios::binary) << "the previous index"; }
  {
    IndexedDatasetWriter writer(prefix, IndexedDType::U16);
    std::vector<int32_t> tokens = {1, 2, 3};
    writer.add_document(tokens);
    EXPECT_THROW(writer.finalize(), Error);
  }
  EXPECT_EQ(read_bytes(prefix + ".idx"), std::vector<uint8_t>(std::string_view("the previous index").begin(),
                                                               std::string_view("the previous index").end()));
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.file(""))) names.insert(entry.path().filename());
  EXPECT_EQ(names, (std::set<std::string>{"corpus.bin", "corpus.idx"}));
}

class DataIndexedMalformed : public ::testing::Test {
 protected:
  // Three sequences of lengths 3, 4, 5 as uint16: .idx is 34 + 12*3 + 8*4 = 102 bytes.
  void SetUp() override {
    prefix_ = dir_.file("corpus");
    write_documents(prefix_, IndexedDType::U16, 3, 3);
    idx_ = read_bytes(prefix_ + ".idx");
    ASSERT_EQ(idx_.size(), 102u);
  }
  std::string idx_path() const { return prefix_ + ".idx"; }
  std::string bin_path() const { return prefix_ + ".bin"; }
  void rewrite() { write_bytes(idx_path(), idx_); }

  TempDir dir_;
  std::string prefix_;
  std::vector<uint8_t> idx_;
  static constexpr size_t kLengths = 34, kPointers = 34 + 4 * 3, kDocuments = 34 + 12 * 3;
};

TEST_F(DataIndexedMalformed, BadMagic) {
  idx_[3] = 'X';
  rewrite();
  expect_rejected(prefix_, idx_path(), "bad magic at byte offset 0");
}

TEST_F(DataIndexedMalformed, UnsupportedVersion) {
  poke<uint64_t>(idx_, 9, 2);
  rewrite();
  expect_rejected(prefix_, idx_path(), "unsupported version 2 at byte offset 9");
}

TEST_F(DataIndexedMalformed, UnknownDTypeCode) {
  idx_[17] = 9;
  rewrite();
  expect_rejected(prefix_, idx_path(), "unknown dtype code 9 at byte offset 17");
}

TEST_F(DataIndexedMalformed, FloatDTypeHoldsNoTokens) {
  idx_[17] = 7;
  rewrite();
  expect_rejected(prefix_, idx_path(), "(float32) at byte offset 17 cannot hold token ids");
}

TEST_F(DataIndexedMalformed, TruncatedHeader) {
  idx_.resize(20);
  rewrite();
  expect_rejected(prefix_, idx_path(), "truncated index: 20 bytes");
}

TEST_F(DataIndexedMalformed, TruncatedArrays) {
  idx_.resize(idx_.size() - 8);
  rewrite();
  expect_rejected(prefix_, idx_path(), "need 102 bytes, the file has 94");
}

TEST_F(DataIndexedMalformed, HugeSequenceCount) {
  poke<uint64_t>(idx_, 18, uint64_t{1} << 62);
  rewrite();
  expect_rejected(prefix_, idx_path(), "truncated index");
}

TEST_F(DataIndexedMalformed, TrailingBytes) {
  idx_.insert(idx_.end(), {0, 0, 0, 0, 0});
  rewrite();
  expect_rejected(prefix_, idx_path(), "5 unexpected bytes after byte offset 102");
}

TEST_F(DataIndexedMalformed, NegativeLength) {
  poke<int32_t>(idx_, kLengths + 4, -1);
  rewrite();
  expect_rejected(prefix_, idx_path(), "sequence 1 has negative length -1 at byte offset 38");
}

TEST_F(DataIndexedMalformed, PointerPastEndOfBin) {
  poke<int64_t>(idx_, kPointers + 16, 1000);
  rewrite();
  expect_rejected(prefix_, bin_path(), "sequence 2 (pointer at byte offset 62");
}

TEST_F(DataIndexedMalformed, LengthPastEndOfBin) {
  poke<int32_t>(idx_, kLengths + 8, 6);
  rewrite();
  expect_rejected(prefix_, bin_path(), "covers bytes [14, 26)");
}

TEST_F(DataIndexedMalformed, TruncatedBin) {
  std::filesystem::resize_file(bin_path(), 20);
  expect_rejected(prefix_, bin_path(), "past its end (20 bytes)");
}

TEST_F(DataIndexedMalformed, NonMonotonicDocumentIndices) {
  poke<int64_t>(idx_, kDocuments + 8, 2);
  poke<int64_t>(idx_, kDocuments + 16, 1);
  rewrite();
  expect_rejected(prefix_, idx_path(), "document index 2 is 1 at byte offset 86");
}

TEST_F(DataIndexedMalformed, DocumentIndicesNotEndingAtSequenceCount) {
  poke<int64_t>(idx_, kDocuments + 24, 2);
  rewrite();
  expect_rejected(prefix_, idx_path(), "last document index is 2 at byte offset 94");
}

TEST_F(DataIndexedMalformed, MissingFile) {
  std::filesystem::remove(bin_path());
  expect_rejected(prefix_, bin_path(), "cannot open");
}

TEST_F(DataIndexedMalformed, TokenOutsideVocabularyWhilePacking) {
  DataConfig config;
  config.source = "indexed";
  config.path = prefix_;
  config.split = "1";
  auto dataset = make_dataset(config, Split::Train, 4, 20, 1);  // tokens go up to 119
  DataLoader loader(*dataset, 2, 1);
  try {
    loader.next();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string message = e.what();
    EXPECT_NE(message.find(bin_path()), std::string::npos) << message;
    EXPECT_NE(message.find("at byte offset"), std::string::npos) << message;
    EXPECT_NE(message.find("outside the model's vocabulary [0, 20)"), std::string::npos) << message;
  }
}

TEST(DataIndexedSplit, MegatronRanges) {
  auto range = [](const std::string& split, Split which, int64_t n) {
    SequenceRange r = split_sequence_range(split, which, n);
    return std::pair<int64_t, int64_t>{r.begin, r.end};
  };
  EXPECT_EQ(range("969,30,1", Split::Train, 1000), (std::pair<int64_t, int64_t>{0, 969}));
  EXPECT_EQ(range("969,30,1", Split::Validation, 1000), (std::pair<int64_t, int64_t>{969, 999}));
  EXPECT_EQ(range("969,30,1", Split::Test, 1000), (std::pair<int64_t, int64_t>{999, 1000}));
  // Python's round() is half-to-even: 0.5 * 5 = 2.5 rounds to 2.
  EXPECT_EQ(range("1,1", Split::Train, 5), (std::pair<int64_t, int64_t>{0, 2}));
  EXPECT_EQ(range("1,1", Split::Validation, 5), (std::pair<int64_t, int64_t>{2, 5}));
  EXPECT_EQ(range("98", Split::Train, 7), (std::pair<int64_t, int64_t>{0, 7}));
  for (const char* bad : {"", "a,b", "1,-1", "1,2,3,4", "0,0,0"}) {
    try {
      split_sequence_range(bad, Split::Train, 10);
      FAIL() << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("data.split"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(split_sequence_range("1,1", Split::Test, 10), Error);
  EXPECT_THROW(split_sequence_range("1,1,1", Split::Test, 1), Error);
}

// Each token encodes (sequence, position) so a packed stream can be parsed back.
TEST(DataIndexedPacking, SamplesTileAShuffledConcatenation) {
  TempDir dir;
  std::string prefix = dir.file("packed");
  IndexedDatasetWriter writer(prefix, IndexedDType::I32);
  const int sequences = 20;
  std::vector<int64_t> lengths;
  for (int s = 0; s < sequences; ++s) {
    std::vector<int32_t> tokens(static_cast<size_t>(1 + (s * 7) % 13));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(s * 1000 + i);
    writer.add_document(tokens);
    lengths.push_back(static_cast<int64_t>(tokens.size()));
  }
  writer.finalize();
  DataConfig config;
  config.source = "indexed";
  config.path = prefix;
  config.split = "3,1";  // train: sequences [0, 15)
  const int64_t seq_len = 6;
  auto dataset = make_dataset(config, Split::Train, seq_len, 100000, 4);
  int64_t train_tokens = 0;
  for (int s = 0; s < 15; ++s) train_tokens += lengths[s];
  ASSERT_EQ(dataset->num_samples(), (train_tokens - 1) / seq_len);
  EXPECT_TRUE(dataset->shuffle_samples());

  std::vector<std::vector<int64_t>> orders;
  for (int64_t epoch : {0, 1}) {
    std::vector<int32_t> stream, sample(static_cast<size_t>(seq_len + 1));
    for (int64_t i = 0; i < dataset->num_samples(); ++i) {
      dataset->sample(epoch, i, sample.data());
      if (i > 0) EXPECT_EQ(sample[0], stream.back()) << "samples overlap by one token";
      stream.insert(stream.end(), sample.begin() + (i > 0 ? 1 : 0), sample.end());
    }
    ASSERT_EQ(static_cast<int64_t>(stream.size()), dataset->num_samples() * seq_len + 1);
    std::vector<int64_t> order;
    for (size_t i = 0; i < stream.size(); ++i) {
      int64_t s = stream[i] / 1000, position = stream[i] % 1000;
      if (position == 0) order.push_back(s);
      ASSERT_FALSE(order.empty());
      EXPECT_EQ(s, order.back()) << "sequences appear whole, in order";
      EXPECT_LT(s, 15) << "only train sequences";
      if (i + 1 < stream.size() && stream[i + 1] % 1000 == 0) EXPECT_EQ(position, lengths[s] - 1);
    }
    EXPECT_EQ(std::set<int64_t>(order.begin(), order.end()).size(), order.size());
    EXPECT_GE(order.size(), 14u);
    orders.push_back(order);
  }
  EXPECT_NE(orders[0], orders[1]) << "documents reshuffled per epoch";

  auto validation = make_dataset(config, Split::Validation, seq_len, 100000, 4);
  std::vector<int32_t> sample(static_cast<size_t>(seq_len + 1));
  validation->sample(0, 0, sample.data());
  for (int32_t token : sample) EXPECT_GE(token / 1000, 15);
}

}  // namespace
}  // namespace forge
