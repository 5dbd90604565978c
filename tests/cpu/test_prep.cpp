// forge prep's library half: decompression, document reading, and prepare_dataset end to
// end with a byte tokenizer (expected ids are the text's bytes + 3, EOS 1), including the
// guarantees that a failed run writes nothing and keeps an existing dataset intact.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>

#include "expect_error.h"
#include "core/error.h"
#include "data/dataset_prep.h"
#include "data/document_reader.h"
#include "data/indexed_dataset.h"
#include "data/input_stream.h"
#include "test_data_temp_dir.h"
#include "test_prep_support.h"

namespace forge {
namespace {

using test::ByteTokenizer;

std::string read_stream(const std::string& path, size_t chunk = 4096) {
  InputStream stream(path);
  std::string data(chunk, '\0'), out;
  while (size_t n = stream.read(data.data(), chunk)) out.append(data.data(), n);
  return out;
}

std::string sample_bytes(size_t size) {
  std::string data;
  uint32_t state = 12345;
  for (size_t i = 0; i < size; ++i) {
    state = state * 1664525u + 1013904223u;
    data.push_back(static_cast<char>(i % 7 == 0 ? '\n' : 'a' + (state >> 24) % 26));
  }
  return data;
}

std::vector<std::string> read_all(const std::vector<std::string>& paths, DocumentReaderOptions options = {}) {
  DocumentReader reader(paths, options);
  std::vector<std::string> documents;
  for (std::string text; reader.next(text);) documents.push_back(text);
  return documents;
}

// The documents of a prepared dataset, as token lists (one sequence per document, or
// none for an empty one).
std::vector<std::vector<int64_t>> read_dataset(const std::string& prefix) {
  IndexedDataset data(prefix);
  std::vector<std::vector<int64_t>> documents;
  for (int64_t d = 0; d < data.num_documents(); ++d) {
    std::vector<int64_t> tokens;
    for (int64_t s = data.document_index(d); s < data.document_index(d + 1); ++s)
      for (int64_t i = 0; i < data.sequence_length(s); ++i) tokens.push_back(data.token(s, i));
    documents.push_back(tokens);
  }
  return documents;
}

std::vector<int64_t> byte_ids(const std::string& text, bool eos = true) {
  std::vector<int64_t> ids;
  for (unsigned char c : text) ids.push_back(c + 3);
  if (eos && !text.empty()) ids.push_back(1);
  return ids;
}

TEST(PrepInputStream, GzipAndZstdRoundTripAcrossMembersAndFrames) {
  TempDir dir;
  const std::string data = sample_bytes(3'000'000);
  test::write_gzip_file(dir.file("a.txt.gz"), data, 3);
  test::write_zstd_file(dir.file("a.txt.zst"), data, 3);
  test::write_file(dir.file("a.txt"), data);
  for (const char* name : {"a.txt.gz", "a.txt.zst", "a.txt"}) {
    EXPECT_EQ(read_stream(dir.file(name)), data) << name;
    EXPECT_EQ(read_stream(dir.file(name), 7), data) << name << " in 7-byte reads";
  }
  InputStream stream(dir.file("a.txt.zst"));
  std::string buffer(1 << 16, '\0');
  while (stream.read(buffer.data(), buffer.size()) > 0) {
  }
  EXPECT_EQ(stream.file_bytes_read(), std::filesystem::file_size(dir.file("a.txt.zst")));
}

TEST(PrepInputStream, EmptyCompressedFilesAreEmpty) {
  TempDir dir;
  test::write_gzip_file(dir.file("e.txt.gz"), "");
  test::write_zstd_file(dir.file("e.txt.zst"), "");
  test::write_file(dir.file("z.txt.zst"), "");
  EXPECT_EQ(read_stream(dir.file("e.txt.gz")), "");
  EXPECT_EQ(read_stream(dir.file("e.txt.zst")), "");
  EXPECT_EQ(read_stream(dir.file("z.txt.zst")), "");
}

TEST(PrepInputStream, TruncatedAndCorruptFilesNameTheFile) {
  TempDir dir;
  const std::string data = sample_bytes(200'000);
  for (const char* name : {"t.txt.gz", "t.txt.zst"}) {
    const std::string path = dir.file(name);
    if (compression_of(path) == Compression::Gzip) {
      test::write_gzip_file(path, data);
    } else {
      test::write_zstd_file(path, data);
    }
    const std::string whole = test::read_file(path);
    test::write_file(path, whole.substr(0, whole.size() / 2));
    expect_error([&] { read_stream(path); }, {path, "truncated"});
    std::string corrupt = whole;
    for (size_t i = 20; i < 60; ++i) corrupt[i] = static_cast<char>(corrupt[i] ^ 0x5A);
    test::write_file(path, corrupt);
    expect_error([&] { read_stream(path); }, {path, "corrupt"});
  }
  expect_error([&] { InputStream stream(dir.file("missing.jsonl")); }, {dir.file("missing.jsonl"), "cannot open"});
}

TEST(PrepDocuments, JsonLinesTextFilesAndTextPerLine) {
  TempDir dir;
  test::write_file(dir.file("a.jsonl"),
                        "{\"text\": \"first\", \"id\": 1}\n\n  \n{\"text\": \"sec\\nond \\u00e9\"}\r\n{\"text\": \"\"}");
  test::write_file(dir.file("b.txt"), "whole file\nis one document\n");
  test::write_file(dir.file("c.txt"), "line one\r\n\nline two\nlast without newline");
  EXPECT_EQ(read_all({dir.file("a.jsonl"), dir.file("b.txt")}),
            (std::vector<std::string>{"first", "sec\nond \xc3\xa9", "", "whole file\nis one document\n"}));
  EXPECT_EQ(read_all({dir.file("c.txt")}, {.text_per_line = true}),
            (std::vector<std::string>{"line one", "line two", "last without newline"}));
  EXPECT_EQ(read_all({dir.file("c.txt")}), (std::vector<std::string>{"line one\r\n\nline two\nlast without newline"}));
  test::write_file(dir.file("k.jsonl"), "{\"content\": \"x\"}\n");
  EXPECT_EQ(read_all({dir.file("k.jsonl")}, {.json_key = "content"}), (std::vector<std::string>{"x"}));
}

TEST(PrepDocuments, SmallBuffersReadTheSameDocuments) {
  // Lines and compressed members cross refills of the buffer (and of the file chunk, a
  // quarter of it) at every size; the documents and the bytes counted do not change.
  TempDir dir;
  std::string jsonl;
  for (int i = 0; i < 40; ++i) jsonl += "{\"text\": \"document " + std::to_string(i) + std::string(i * 7, 'x') + "\"}\r\n\n";
  const std::string text = "line one\r\n\nline two " + std::string(300, 'y') + "\nlast without newline";
  test::write_file(dir.file("a.jsonl"), jsonl);
  test::write_gzip_file(dir.file("a.jsonl.gz"), jsonl, 3);
  test::write_zstd_file(dir.file("a.jsonl.zst"), jsonl, 3);
  test::write_file(dir.file("t.txt"), text);
  test::write_zstd_file(dir.file("t.txt.zst"), text, 2);
  for (const char* name : {"a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "t.txt", "t.txt.zst"}) {
    for (bool per_line : {false, true}) {
      const std::vector<std::string> expected = read_all({dir.file(name)}, {.text_per_line = per_line});
      ASSERT_FALSE(expected.empty()) << name;
      for (size_t bytes : {1, 2, 3, 7, 64, 4096}) {
        DocumentReader reader({dir.file(name)}, {.text_per_line = per_line, .buffer_bytes = bytes});
        std::vector<std::string> documents;
        for (std::string document; reader.next(document);) documents.push_back(document);
        EXPECT_EQ(documents, expected) << name << " with a buffer of " << bytes << " bytes";
        EXPECT_EQ(reader.file_bytes_read(), std::filesystem::file_size(dir.file(name))) << name;
      }
    }
  }
}

TEST(PrepDocuments, MalformedLinesNameFileAndLine) {
  TempDir dir;
  const std::string path = dir.file("bad.jsonl");
  test::write_file(path, "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": \"unterminated}\n");
  expect_error([&] { read_all({path}); }, {path + ":3:", "not valid JSON", "--skip-bad-lines"});
  test::write_file(path, "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
  expect_error([&] { read_all({path}); }, {path + ":2:", "no key \"text\""});
  test::write_file(path, "{\"text\": 5}\n");
  expect_error([&] { read_all({path}); }, {path + ":1:", "is a number, expected a string"});
  test::write_file(path, "[1, 2]\n");
  expect_error([&] { read_all({path}); }, {path + ":1:", "expected a JSON object"});

  test::write_file(path, "{\"text\": \"a\"}\nnot json\n{\"text\": 5}\n{\"text\": \"b\"}\n");
  DocumentReader reader({path}, {.skip_bad_lines = true});
  std::vector<std::string> documents;
  for (std::string text; reader.next(text);) documents.push_back(text);
  EXPECT_EQ(documents, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(reader.skipped_lines(), 2);

  expect_error([&] { read_all({dir.file("data.csv")}); }, {dir.file("data.csv"), "unknown input format", ".jsonl"});
}

TEST(PrepDataset, DtypeFollowsMegatronOptimalDtype) {
  EXPECT_EQ(token_dtype_for_vocab(32000), IndexedDType::U16);
  EXPECT_EQ(token_dtype_for_vocab(65499), IndexedDType::U16);
  EXPECT_EQ(token_dtype_for_vocab(65500), IndexedDType::I32);
  EXPECT_EQ(token_dtype_for_vocab(128256), IndexedDType::I32);
}

TEST(PrepDataset, AllInputKindsInOrderWithEod) {
  TempDir dir;
  std::vector<std::string> texts;
  std::string jsonl;
  for (int i = 0; i < 50; ++i) {
    texts.push_back("document " + std::to_string(i) + std::string(static_cast<size_t>(i % 7), '!'));
    jsonl += "{\"text\": \"" + texts.back() + "\"}\n";
  }
  test::write_file(dir.file("a.jsonl"), jsonl);
  test::write_gzip_file(dir.file("b.jsonl.gz"), jsonl, 2);
  test::write_zstd_file(dir.file("c.json.zst"), jsonl, 2);
  test::write_file(dir.file("d.txt"), "plain text\nfile\n");
  test::write_zstd_file(dir.file("e.txt.zst"), "one\ntwo\n");
  test::write_file(dir.file("f.jsonl"), "{\"text\": \"\"}\n{\"text\": \"after empty\"}\n");

  ByteTokenizer tokenizer;
  PrepOptions options{.inputs = {dir.file("a.jsonl"), dir.file("b.jsonl.gz"), dir.file("c.json.zst"),
                                 dir.file("d.txt"), dir.file("e.txt.zst"), dir.file("f.jsonl")},
                      .output_prefix = dir.file("out/corpus"),
                      .workers = 3};
  int progress_calls = 0;
  PrepSummary summary = prepare_dataset(options, tokenizer, [&](const PrepProgress&) { ++progress_calls; });

  std::vector<std::vector<int64_t>> expected;
  for (int copy = 0; copy < 3; ++copy)
    for (const auto& text : texts) expected.push_back(byte_ids(text));
  expected.push_back(byte_ids("plain text\nfile\n"));
  expected.push_back(byte_ids("one\ntwo\n"));
  expected.push_back({});
  expected.push_back(byte_ids("after empty"));
  EXPECT_EQ(read_dataset(dir.file("out/corpus")), expected);

  IndexedDataset data(dir.file("out/corpus"));
  EXPECT_EQ(data.dtype(), IndexedDType::U16);
  EXPECT_EQ(data.num_sequences(), static_cast<int64_t>(expected.size()) - 1) << "the empty document has no sequence";
  EXPECT_EQ(summary.documents, static_cast<int64_t>(expected.size()));
  EXPECT_EQ(summary.empty_documents, 1);
  int64_t tokens = 0;
  for (const auto& document : expected) tokens += static_cast<int64_t>(document.size());
  EXPECT_EQ(summary.tokens, tokens);
  uint64_t input_bytes = 0;
  for (const auto& input : options.inputs) input_bytes += std::filesystem::file_size(input);
  EXPECT_EQ(summary.input_bytes, input_bytes);
  EXPECT_EQ(summary.output_bytes, std::filesystem::file_size(dir.file("out/corpus.bin")) +
                                      std::filesystem::file_size(dir.file("out/corpus.idx")));
  EXPECT_GE(progress_calls, 1);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.file("out")), {}), 2) << "no temporary files left";
}

TEST(PrepDataset, WithoutEodAndWithALargeVocabulary) {
  TempDir dir;
  test::write_file(dir.file("a.txt"), "ab\ncd\n");
  ByteTokenizer tokenizer(70000, 65600, std::nullopt);
  PrepOptions options{.inputs = {dir.file("a.txt")}, .output_prefix = dir.file("big"), .append_eod = false,
                      .text_per_line = true};
  prepare_dataset(options, tokenizer);
  IndexedDataset data(dir.file("big"));
  EXPECT_EQ(data.dtype(), IndexedDType::I32);
  EXPECT_EQ(read_dataset(dir.file("big")),
            (std::vector<std::vector<int64_t>>{{'a' + 65600, 'b' + 65600}, {'c' + 65600, 'd' + 65600}}));

  options.append_eod = true;
  expect_error([&] { prepare_dataset(options, tokenizer); }, {"no EOS token", "--no-append-eod"});
}

TEST(PrepDataset, OutputDoesNotDependOnTheNumberOfWorkers) {
  TempDir dir;
  std::string jsonl;
  for (int i = 0; i < 20000; ++i) jsonl += "{\"text\": \"doc " + std::to_string(i * 7919 % 10007) + "\"}\n";
  test::write_zstd_file(dir.file("many.jsonl.zst"), jsonl);
  ByteTokenizer tokenizer;
  for (int workers : {1, 4}) {
    PrepOptions options{.inputs = {dir.file("many.jsonl.zst")},
                        .output_prefix = dir.file("w" + std::to_string(workers)),
                        .workers = workers};
    EXPECT_EQ(prepare_dataset(options, tokenizer).documents, 20000);
  }
  EXPECT_EQ(test::read_file(dir.file("w1.bin")), test::read_file(dir.file("w4.bin")));
  EXPECT_EQ(test::read_file(dir.file("w1.idx")), test::read_file(dir.file("w4.idx")));
}

// A failure late in the input (after many documents were written) must leave no new
// .bin/.idx, remove the temporary files, and keep the dataset already at the prefix.
TEST(PrepDataset, FailedRunKeepsExistingDatasetAndLeavesNoFiles) {
  TempDir dir;
  std::string good;
  for (int i = 0; i < 30000; ++i) good += "{\"text\": \"doc " + std::to_string(i) + "\"}\n";
  test::write_file(dir.file("good.jsonl"), good);
  test::write_gzip_file(dir.file("late_bad.jsonl.gz"), good + "{\"text\": broken}\n");
  ByteTokenizer tokenizer;

  const std::string fresh = dir.file("fresh");
  expect_error([&] { prepare_dataset({.inputs = {dir.file("late_bad.jsonl.gz")}, .output_prefix = fresh}, tokenizer); },
               {dir.file("late_bad.jsonl.gz") + ":30001:", "not valid JSON"});
  EXPECT_FALSE(std::filesystem::exists(fresh + ".bin"));
  EXPECT_FALSE(std::filesystem::exists(fresh + ".idx"));

  const std::string existing = dir.file("existing");
  prepare_dataset({.inputs = {dir.file("good.jsonl")}, .output_prefix = existing}, tokenizer);
  const std::string bin = test::read_file(existing + ".bin"), idx = test::read_file(existing + ".idx");
  expect_error(
      [&] {
        prepare_dataset({.inputs = {dir.file("good.jsonl"), dir.file("late_bad.jsonl.gz")}, .output_prefix = existing},
                        tokenizer);
      },
      {":30001:"});
  tokenizer.fail_on = "doc 29999";
  expect_error([&] { prepare_dataset({.inputs = {dir.file("good.jsonl")}, .output_prefix = existing}, tokenizer); },
               {"tokenizer failed"});
  expect_error(
      [&] {
        prepare_dataset({.inputs = {dir.file("good.jsonl"), dir.file("missing.jsonl")}, .output_prefix = existing},
                        tokenizer);
      },
      {dir.file("missing.jsonl"), "not found"});
  EXPECT_EQ(test::read_file(existing + ".bin"), bin);
  EXPECT_EQ(test::read_file(existing + ".idx"), idx);

  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.file(""))) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"existing.bin", "existing.idx", "good.jsonl", "late_bad.jsonl.gz"}));
}

TEST(PrepDataset, BadOptionsAreRefusedBeforeWriting) {
  TempDir dir;
  test::write_file(dir.file("a.jsonl"), "{\"text\": \"x\"}\n");
  ByteTokenizer tokenizer;
  expect_error([&] { prepare_dataset({.inputs = {}, .output_prefix = dir.file("o")}, tokenizer); }, {"--input"});
  expect_error([&] { prepare_dataset({.inputs = {dir.file("a.jsonl")}, .output_prefix = dir.file("o.bin")}, tokenizer); },
               {"ends with .bin", "without it"});
  expect_error([&] { prepare_dataset({.inputs = {dir.file("a.jsonl")}, .output_prefix = dir.file("")}, tokenizer); },
               {"is a directory"});
  expect_error([&] { prepare_dataset({.inputs = {dir.file("a.csv")}, .output_prefix = dir.file("o")}, tokenizer); },
               {"unknown input format"});
  EXPECT_FALSE(std::filesystem::exists(dir.file("o.bin")));
}

}  // namespace
}  // namespace forge
