// load_tokenizer decides what a path holds and builds the matching Tokenizer; encode_batch
// spreads documents over the thread pool. Documents differ widely in length, so threads
// take the next document from a shared counter instead of fixed slices; each result
// lands in its own slot, so the output does not depend on the thread count.
#include "data/tokenizer.h"

#include <atomic>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/input_file.h"
#include "core/json_input.h"
#include "core/parallel.h"
#include "data/hf_tokenizer.h"
#include "data/sentencepiece_tokenizer.h"
#include "data/tiktoken_bpe_file.h"
#include "data/tiktoken_tokenizer.h"

namespace forge {
namespace {

enum class TokenizerFormat { HuggingFaceJson, SentencePieceModel, TiktokenBpe };

// tokenizer.json is JSON (an object); tokenizer.model is a SentencePiece protobuf whose
// first field is the repeated `pieces` (tag byte 0x0A), or a tiktoken BPE file (text
// lines '<base64> <rank>', as Meta ships Llama 3's).
TokenizerFormat detect_format(const std::string& file) {
  require_regular_file(file, "the tokenizer file");
  std::ifstream in(file, std::ios::binary);
  if (!in) FORGE_FAIL("{}: cannot open the tokenizer file", file);
  char first_byte = 0, first = 0;
  bool content = static_cast<bool>(in.get(first_byte));
  first = first_byte;
  while (content && (first == ' ' || first == '\n' || first == '\r' || first == '\t'))
    content = static_cast<bool>(in.get(first));
  if (!content) FORGE_FAIL("{}: the tokenizer file is empty", file);
  const std::string extension = std::filesystem::path(file).extension().string();
  if (first == '{' || extension == ".json") return TokenizerFormat::HuggingFaceJson;
  if (looks_like_tiktoken_bpe(file)) return TokenizerFormat::TiktokenBpe;
  // The protobuf's first byte itself (a 0x0A is also a newline, which the JSON check skips).
  if (first_byte == '\x0A' || extension == ".model") return TokenizerFormat::SentencePieceModel;
  FORGE_FAIL("{}: neither a Hugging Face tokenizer.json (JSON), a SentencePiece tokenizer.model (protobuf) nor a "
             "tiktoken BPE tokenizer.model (lines '<base64> <rank>')",
             file);
}

std::unique_ptr<Tokenizer> load_json(const std::string& file) {
  return std::make_unique<HfTokenizer>(read_json_file(file, "the tokenizer file"), file);
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  std::string file = path;
  if (fs::is_directory(path)) {
    if (fs::is_regular_file(fs::path(path) / "tokenizer.json")) {
      file = (fs::path(path) / "tokenizer.json").string();
    } else if (fs::is_regular_file(fs::path(path) / "tokenizer.model")) {
      file = (fs::path(path) / "tokenizer.model").string();
    } else {
      FORGE_FAIL("{}: the directory holds neither tokenizer.json nor tokenizer.model", path);
    }
  } else if (!fs::exists(path)) {
    FORGE_FAIL("{}: no such tokenizer file or directory", path);
  }
  switch (detect_format(file)) {
    case TokenizerFormat::HuggingFaceJson:
      return load_json(file);
    case TokenizerFormat::SentencePieceModel:
      return std::make_unique<SentencePieceTokenizer>(file);
    case TokenizerFormat::TiktokenBpe:
      return std::make_unique<TiktokenTokenizer>(file);
  }
  FORGE_CHECK(false, "unreachable tokenizer format");
  return nullptr;
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string_view>& texts) const {
  std::vector<std::vector<int32_t>> ids(texts.size());
  std::atomic<size_t> next{0};
  parallel_for(num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (size_t i = next++; i < texts.size(); i = next++) ids[i] = encode(texts[i]);
    }
  });
  return ids;
}

}  // namespace forge
