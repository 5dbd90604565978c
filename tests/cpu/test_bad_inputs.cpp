// Regression tests for the classes of bad input that a mutation campaign through an
// ASan/UBSan build found (issue 18): one suite per class, each case a representative of
// what the class covers. Every bad input must end in a forge::Error that names the file,
// key or field, in bounded time, never in undefined behaviour, a crash or a hang.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/report_chart.h"
#include "bench/report_data.h"
#include "ckpt/checkpoint_metadata.h"
#include "ckpt/hf_config.h"
#include "ckpt/safetensors.h"
#include "cli/config.h"
#include "cli/config_defaults.h"
#include "core/filesystem_error.h"
#include "core/input_file.h"
#include "core/json_input.h"
#include "core/tensor.h"
#include "data/blended_dataset.h"
#include "data/indexed_dataset.h"
#include "data/input_stream.h"
#include "data/tokenizer.h"
#include "expect_error.h"
#include "model/decoder_lm.h"
#include "test_data_temp_dir.h"
#include "train/memory_check.h"
#include "train/run_dir.h"

namespace forge {
namespace {

const std::string k2To62 = "4611686018427387904";

std::string write(const TempDir& dir, const std::string& name, const std::string& content) {
  const std::string path = dir.file(name);
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

std::string nested(char open, char close, int depth, const std::string& inner = "") {
  return std::string(static_cast<size_t>(depth), open) + inner + std::string(static_cast<size_t>(depth), close);
}

// A small tokenizer.json (byte-level BPE over "ab") whose pipelines the tests replace.
nlohmann::json small_tokenizer() {
  return nlohmann::json::parse(R"({
    "added_tokens": [], "normalizer": null, "pre_tokenizer": null, "decoder": null,
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}})");
}

nlohmann::json hf_config() {
  return nlohmann::json::parse(R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})");
}

nlohmann::json checkpoint_metadata() {
  CheckpointMetadata md;
  md.model = debug_tiny_model();
  md.flat_numel = 8;
  md.shards = {{0, 8}};
  md.tensors = {{"w", FlatState::Param, {2, 4}, 0, {{0, 0, 0, 32, 0}}}};
  return nlohmann::json::parse(metadata_to_json(md));
}

// --- Signed overflow on huge sizes -----------------------------------------------------

TEST(BadInputSizeOverflow, ModelKeysNear2To62AreRefusedNamingTheKeys) {
  for (const char* key : {"model.hidden_size", "model.ffn_hidden_size", "model.head_dim"})
    expect_error([&] { load_experiment("", {{key, k2To62}}); }, {key, "2^50"});
  expect_error([&] { load_experiment("", {{"model.num_layers", k2To62}}); }, {"model.num_layers", "65536"});
  expect_error([&] { load_experiment("", {{"model.vocab_size", k2To62}}); }, {"model.vocab_size", "2147483647"});
  ModelConfig m = debug_tiny_model();
  m.num_heads = m.num_kv_heads = int64_t{1} << 61;
  m.head_dim = 2;
  expect_error([&] { m.validate(); }, {"overflows 64-bit integers", "model.num_heads"});
  EXPECT_THROW(m.total_params(), Error);  // unvalidated: a check, never a wrapped count
}

TEST(BadInputSizeOverflow, BatchProductsAreChecked) {
  expect_error(
      [&] { load_experiment("", {{"training.local_batch_size", k2To62}, {"training.gradient_accumulation_steps", "4"}}); },
      {"training.local_batch_size", "overflows 64-bit integers"});
}

TEST(BadInputSizeOverflow, HuggingFaceConfigSizesAreChecked) {
  nlohmann::json config = hf_config();
  config["hidden_size"] = int64_t{1} << 62;
  config["num_attention_heads"] = 2;
  expect_error([&] { model_config_from_hf(config, "big/config.json"); }, {"big/config.json", "model.hidden_size"});
}

TEST(BadInputSizeOverflow, CheckpointMetadataShapesAndOffsetsAreBounded) {
  nlohmann::json md = checkpoint_metadata();
  md["tensors"][0]["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
  expect_error([&] { metadata_from_json(md.dump(), "ck/metadata.json"); }, {"ck/metadata.json", "'w'", "2^56"});
  md = checkpoint_metadata();
  md["tensors"][0]["shape"] = {int64_t{1} << 62, 4};
  expect_error([&] { metadata_from_json(md.dump(), "ck/metadata.json"); }, {"ck/metadata.json", "2^56"});
  md = checkpoint_metadata();
  md["tensors"][0]["flat_offset"] = INT64_MAX;
  expect_error([&] { metadata_from_json(md.dump(), "ck/metadata.json"); }, {"tensors[0].flat_offset"});
  md = checkpoint_metadata();
  md["tensors"][0]["pieces"][0]["byte_length"] = INT64_MAX;
  expect_error([&] { metadata_from_json(md.dump(), "ck/metadata.json"); }, {"tensors[0].pieces[0].byte_length"});
  md = checkpoint_metadata();
  md["flat_numel"] = -1;
  expect_error([&] { metadata_from_json(md.dump(), "ck/metadata.json"); }, {"'flat_numel'"});
  EXPECT_NO_THROW(metadata_from_json(checkpoint_metadata().dump(), "ck/metadata.json"));
}

TEST(BadInputSizeOverflow, ShapeAndActivationSizesNeverWrap) {
  EXPECT_FALSE(checked_numel({int64_t{1} << 40, int64_t{1} << 40}).has_value());
  EXPECT_THROW(shape_numel({int64_t{1} << 40, int64_t{1} << 40}), Error);
  expect_error([&] { activation_bytes(debug_tiny_model(), int64_t{1} << 40, int64_t{1} << 40, DType::F32,
                                      ActivationCheckpoint::None); },
               {"training.local_batch_size × training.seq_len", "overflows"});
  expect_error([&] { activation_bytes(debug_tiny_model(), 1, int64_t{1} << 55, DType::F32, ActivationCheckpoint::None); },
               {"activation memory overflows"});
}

// --- Allocations sized by unchecked input ---------------------------------------------

TEST(BadInputAllocation, TokenizerIdsFarBeyondTheVocabularyAreRefused) {
  TempDir dir;
  nlohmann::json config = small_tokenizer();
  config["model"]["vocab"]["ab"] = 2147483647;
  expect_error([&] { load_tokenizer(write(dir, "huge-id.json", config.dump())); },
               {"huge-id.json", "model.vocab", "2147483647", "far beyond"});
  config = small_tokenizer();
  config["added_tokens"] = {{{"id", 1 << 30}, {"content", "<eos>"}, {"special", true}}};
  expect_error([&] { load_tokenizer(write(dir, "huge-added.json", config.dump())); }, {"added_tokens", "far beyond"});
}

TEST(BadInputAllocation, TheCpuMemoryCheckStopsAbsurdSizesFirst) {
  for (const ConfigOverrides& overrides :
       {ConfigOverrides{{"training.seq_len", "1099511627776"}, {"model.max_seq_len", "1099511627776"}},
        ConfigOverrides{{"training.local_batch_size", "1099511627776"}},
        ConfigOverrides{{"model.num_layers", "4096"}, {"model.hidden_size", "65536"}, {"model.num_heads", "512"},
                        {"model.num_kv_heads", "512"}}}) {
    const ExperimentConfig config = load_experiment("", overrides);
    try {
      check_memory_fits(config);
      FAIL() << "the memory check let " << overrides.front().first << " through";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("host memory"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("GiB"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(check_memory_fits(load_experiment("", {})));
}

// --- Deeply nested JSON ----------------------------------------------------------------

TEST(BadInputDeepJson, NestingIsBoundedBeforeParsing) {
  const std::string deep = nested('[', ']', 200000);
  expect_error([&] { parse_json(deep, "deep.json"); }, {"deep.json", "nested deeper than 128"});
  // Brackets inside strings do not count.
  EXPECT_NO_THROW(parse_json("{\"a\": \"" + std::string(1000, '[') + "\"}", "strings.json"));
  EXPECT_NO_THROW(parse_json(nested('[', ']', 128), "ok.json"));
}

TEST(BadInputDeepJson, DepthCheckFollowsStringsAndEscapes) {
  // 129 levels: the error names the byte of the 129th bracket.
  expect_error([&] { check_json_depth("  " + nested('{', '}', 129), "deep.json"); }, {"deep.json", "(at byte 130)"});
  // An escaped quote does not end a string, an escaped backslash before a quote does.
  const std::string inside = "\"\\\"" + std::string(200, '[') + "\"";  // "\"[[[...": one string
  EXPECT_NO_THROW(check_json_depth(inside, "escaped-quote.json"));
  const std::string outside = "[\"\\\\\"," + nested('[', ']', 128) + "]";  // ["\\", [[...]]]: 129 levels
  expect_error([&] { check_json_depth(outside, "escaped-backslash.json"); }, {"escaped-backslash.json", "nested deeper"});
  EXPECT_NO_THROW(check_json_depth("[\"\\\\\"," + nested('[', ']', 127) + "]", "ok.json"));
  // Closing brackets inside strings do not count either; an unterminated string ends the check.
  expect_error([&] { check_json_depth("[\"]]]]\"," + nested('[', ']', 128) + "]", "closers.json"); },
               {"closers.json", "nested deeper"});
  EXPECT_NO_THROW(check_json_depth("\"" + std::string(300, '['), "unterminated.json"));
}

TEST(BadInputDeepJson, EveryJsonReaderRefusesDeepNesting) {
  TempDir dir;
  const std::string deep = nested('[', ']', 100000);
  expect_error([&] { load_tokenizer(write(dir, "tokenizer.json", "{\"model\": " + deep + "}")); },
               {"tokenizer.json", "nested deeper"});
  expect_error([&] { read_json_file(write(dir, "config.json", "{\"architectures\": " + deep + "}")); },
               {"config.json", "nested deeper"});
  expect_error([&] { metadata_from_json("{\"format\": " + deep + "}", "ck/metadata.json"); },
               {"ck/metadata.json", "nested deeper"});
  const std::string header = "{\"__metadata__\": " + deep + "}";
  std::string file(8, '\0');
  const uint64_t length = header.size();
  std::memcpy(file.data(), &length, 8);
  expect_error([&] { SafetensorsFile(write(dir, "deep.safetensors", file + header)); },
               {"deep.safetensors", "nested deeper"});
  write(dir, "bench.json", deep);
  expect_error([&] { load_bench_results(dir.file("bench.json")); }, {"bench.json", "nested deeper"});
}

TEST(BadInputDeepJson, MessagesDescribeValuesWithoutPrintingThem) {
  const nlohmann::json big = nlohmann::json::parse(nested('[', ']', 100));
  EXPECT_EQ(describe_json(big), "a list of 1 item");
  EXPECT_EQ(describe_json(nlohmann::json::parse(R"({"a": 1, "b": 2})")), "an object of 2 members");
  EXPECT_EQ(describe_json(nlohmann::json(std::string(1000, 'x'))), "\"" + std::string(60, 'x') + "\"... (1000 bytes)");
  EXPECT_EQ(describe_json(nlohmann::json(12)), "12");
  nlohmann::json config = hf_config();
  config["architectures"] = nlohmann::json::parse(nested('[', ']', 100));
  const std::string message = error_of([&] { model_config_from_hf(config, "c/config.json"); });
  EXPECT_NE(message.find("a list of 1 item"), std::string::npos) << message;
  EXPECT_LT(message.size(), 300u);
}

TEST(BadInputDeepJson, TokenizerSequencesAreDepthBounded) {
  TempDir dir;
  nlohmann::json normalizer = {{"type", "Prepend"}, {"prepend", "x"}};
  for (int i = 0; i < 20; ++i) normalizer = {{"type", "Sequence"}, {"normalizers", {normalizer}}};
  nlohmann::json config = small_tokenizer();
  config["normalizer"] = normalizer;
  expect_error([&] { load_tokenizer(write(dir, "nested.json", config.dump())); },
               {"nested.json", "Sequences nested more than 16 deep"});
}

// --- JSON numbers out of range and other JSON errors ----------------------------------

TEST(BadInputJsonErrors, NumbersOutOfRangeNameTheFile) {
  TempDir dir;
  expect_error([&] { read_json_file(write(dir, "config.json", R"({"vocab_size": 1e400})")); },
               {"config.json", "not valid JSON", "1e400"});
  expect_error([&] { metadata_from_json(R"({"format": 1e400})", "ck/metadata.json"); }, {"ck/metadata.json"});
  nlohmann::json md = checkpoint_metadata();
  std::string text = md.dump();
  text.replace(text.find("\"flat_numel\":8"), 14, "\"flat_numel\":-1e400");
  expect_error([&] { metadata_from_json(text, "ck/metadata.json"); }, {"ck/metadata.json", "not valid JSON"});
}

TEST(BadInputJsonErrors, ReportInputsNameFileAndLine) {
  TempDir dir;
  write(dir, "metrics.jsonl", "{\"type\": \"run\", \"model\": \"m\", \"parameters\": 1}\n{\"type\": \"train\", \"loss\": 1e400}\n");
  expect_error([&] { load_report_run(dir.file("")); }, {"metrics.jsonl:2", "not valid JSON"});
  write(dir, "metrics.jsonl", "{\"type\": \"run\", \"model\": \"m\", \"parameters\": 1}\n");
  write(dir, "config.yaml", "training: 5\n");  // yaml-cpp throws on a key of a scalar
  expect_error([&] { load_report_run(dir.file("")); }, {"config.yaml", "not a readable config"});
  write(dir, "config.yaml", "training:\n  seq_len: [1, 2]\n");
  expect_error([&] { load_report_run(dir.file("")); }, {"config.yaml", "training.seq_len"});
  write(dir, "config.yaml", "- a list\n");
  expect_error([&] { load_report_run(dir.file("")); }, {"config.yaml", "mapping"});
}

TEST(BadInputJsonErrors, ChartsOfExtremeLossesRender) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (const auto& points : std::vector<std::vector<std::pair<double, double>>>{
           {{1, 1e308}, {2, -1e308}, {3, inf}, {4, nan}},
           {{1, 1.7e308}},
           {{1, -1.7e308}},
           {{-9e18, 1}, {9e18, 2}},
           {{1, 1e308}, {2, 1.7e308}}}) {
    std::string svg = chart_svg({"step", "loss", {{"run", "#000", points, false}}});
    EXPECT_NE(svg.find("</svg>"), std::string::npos);
    for (size_t at; (at = svg.find("dominant-baseline")) != std::string::npos;) svg.erase(at, 17);
    EXPECT_EQ(svg.find("nan"), std::string::npos) << svg;
    EXPECT_EQ(svg.find("inf"), std::string::npos) << svg;
  }
  const std::vector<double> ticks = nice_ticks(-1e308, 1e308, 5);
  ASSERT_FALSE(ticks.empty());
  for (double t : ticks) EXPECT_TRUE(std::isfinite(t));
}

// --- Files that are not regular files --------------------------------------------------

TEST(BadInputNonRegularFile, NamedPipesAreRefusedNotWaitedOn) {
  TempDir dir;
  const std::string fifo = dir.file("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<std::string> fragments = {fifo, "named pipe, not a regular file"};
  expect_error([&] { read_regular_file(fifo, "a file"); }, fragments);
  expect_error([&] { read_json_file(fifo, "config.json"); }, fragments);
  expect_error([&] { load_tokenizer(fifo); }, fragments);
  expect_error([&] { SafetensorsFile file(fifo); }, fragments);
  expect_error([&] { InputStream stream(fifo); }, fragments);
  expect_error([&] { load_experiment(fifo, {}); }, {fifo});
  expect_error([&] { load_bench_results(fifo); }, fragments);
  ASSERT_EQ(::mkfifo(dir.file("data.idx").c_str(), 0600), 0);
  write(dir, "data.bin", "");
  expect_error([&] { IndexedDataset dataset(dir.file("data")); }, {"data.idx", "named pipe"});
  ASSERT_EQ(::mkfifo(dir.file("metrics.jsonl").c_str(), 0600), 0);
  expect_error([&] { load_report_run(dir.file("")); }, {"metrics.jsonl"});
  std::filesystem::create_directory(dir.file("folder"));
  expect_error([&] { read_regular_file(dir.file("folder"), "a file"); }, {"folder", "a directory"});
  expect_error([&] { read_regular_file("/dev/zero", "a file"); }, {"/dev/zero", "character device"});
}

// --- Hangs on small pathological inputs ------------------------------------------------

TEST(BadInputPathologicalPipeline, EmptyMatchingReplaceIsRefused) {
  TempDir dir;
  nlohmann::json steps = nlohmann::json::array();
  for (int i = 0; i < 12; ++i)
    steps.push_back({{"type", "Replace"}, {"pattern", {{"Regex", ""}}}, {"content", "ab"}});
  nlohmann::json config = small_tokenizer();
  config["normalizer"] = {{"type", "Sequence"}, {"normalizers", steps}};
  expect_error([&] { load_tokenizer(write(dir, "empty-replace.json", config.dump())); },
               {"empty-replace.json", "normalizer.normalizers[0]", "matches the empty string"});
}

TEST(BadInputPathologicalPipeline, ThousandsOfStepsAreRefused) {
  TempDir dir;
  nlohmann::json steps = nlohmann::json::array();
  for (int i = 0; i < 5000; ++i) steps.push_back({{"type", "Digits"}, {"individual_digits", true}});
  nlohmann::json config = small_tokenizer();
  config["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", steps}};
  expect_error([&] { load_tokenizer(write(dir, "many.json", config.dump())); },
               {"many.json", "pre_tokenizer.pretokenizers[64]", "more than 64 pre-tokenizer steps"});
}

TEST(BadInputPathologicalPipeline, StepsThatFeedOnEachOtherStopGrowing) {
  TempDir dir;
  nlohmann::json steps = nlohmann::json::array();
  for (int i = 0; i < 60; ++i) steps.push_back({{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", "aa"}});
  nlohmann::json config = small_tokenizer();
  config["normalizer"] = {{"type", "Sequence"}, {"normalizers", steps}};
  auto tokenizer = load_tokenizer(write(dir, "doubling.json", config.dump()));
  expect_error([&] { tokenizer->encode("ab"); }, {"doubling.json", "normalizer grew a text of 2 bytes"});
}

TEST(BadInputPathologicalPipeline, RunDirPlaceholdersInNamesExpandOnce) {
  const std::string dir = expand_run_dir("runs/{model}-{time}", "{model}{time}");
  EXPECT_TRUE(dir.starts_with("runs/{model}{time}-")) << dir;
  EXPECT_EQ(dir.size(), std::string("runs/{model}{time}-").size() + 15);  // YYYYmmdd-HHMMSS
}

// --- Silent acceptance ----------------------------------------------------------------

TEST(BadInputSilentAcceptance, SafetensorsHeaderPaddingIsAsStrictAsTheReference) {
  TempDir dir;
  auto file = [](const std::string& header) {
    std::string bytes(8, '\0');
    const uint64_t length = header.size();
    std::memcpy(bytes.data(), &length, 8);
    return bytes + header + std::string(4, '\0');
  };
  const std::string body = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_NO_THROW(SafetensorsFile(write(dir, "spaces.safetensors", file(body + "    "))));
  expect_error([&] { SafetensorsFile(write(dir, "nul.safetensors", file(body + std::string(3, '\0')))); },
               {"nul.safetensors", "NUL byte at offset"});
  expect_error([&] { SafetensorsFile(write(dir, "bom.safetensors", file("\xEF\xBB\xBF" + body))); },
               {"bom.safetensors", "byte-order mark"});
}

TEST(BadInputSilentAcceptance, TwoYamlDocumentsAreRefused) {
  TempDir dir;
  const std::string path = write(dir, "exp.yaml", "training:\n  steps: 3\n---\ntraining:\n  steps: 4\n");
  expect_error([&] { load_experiment(path, {}); }, {"exp.yaml", "2 YAML documents"});
  EXPECT_EQ(load_experiment(write(dir, "one.yaml", "---\ntraining:\n  steps: 3\n"), {}).training.steps, 3);
}

// Found by fuzz_experiment_yaml: yaml-cpp 0.7's LoadAll builds empty documents forever on
// this text (10 GB in 30 s); NOTE [Counting YAML documents] bounds the count.
TEST(BadInputPathologicalPipeline, YamlThatNeverEndsIsRefused) {
  TempDir dir;
  const std::string path = write(dir, "loop.yaml", ",b-trainmodel:\n 6.ing:\nini\nnyg\xe8s=0");
  expect_error([&] { load_experiment(path, {}); }, {"loop.yaml", "invalid YAML"});
}

TEST(BadInputSilentAcceptance, BlendWeightsThatOverflowAreRefused) {
  expect_error([] { parse_blend("1e308 a 1e308 b"); }, {"data.blend", "overflow"});
  expect_error([] { parse_blend("1e300 a 1e-300 b"); }, {"data.blend", "weight 2", "too small"});
  EXPECT_NO_THROW(parse_blend("0.3 a 0.7 b"));
}

}  // namespace
}  // namespace forge

TEST(BadInputFileSystem, RefusedPathsAreDescribedWithPathAndReason) {
  // What forge's commands print when the system refuses a path built from user input.
  const std::string long_name = "/tmp/" + std::string(300, 'x');
  try {
    (void)std::filesystem::status(long_name);
    FAIL() << "the system accepted a 300-byte file name";
  } catch (const std::filesystem::filesystem_error& e) {
    EXPECT_EQ(forge::describe_filesystem_error(e), "'" + long_name + "': File name too long");
  }
  const std::filesystem::filesystem_error two("rename", "/a", "/b", std::make_error_code(std::errc::permission_denied));
  EXPECT_EQ(forge::describe_filesystem_error(two), "'/a' -> '/b': Permission denied");
}
