// forge_tokenize: drives forge's tokenizers from tests/python/test_tokenizer_vs_hf.py,
// test_tiktoken_vs_hf.py and scripts/bench-tokenizer.
//   forge_tokenize --info TOKENIZER           {"vocab_size", "bos_id", "eos_id"} as JSON
//   forge_tokenize TOKENIZER TEXTS.jsonl      one {"ids": [...], "decoded_hex": "..."} line
//                                             per input line
//   forge_tokenize --bench TOKENIZER TEXTS.jsonl   {"bytes", "tokens", "seconds", "threads"}
//   forge_tokenize --decode TOKENIZER IDS.jsonl    one {"decoded_hex": "..."} line per
//                                                  input line {"ids": [...]}
// Each input line is {"text": "..."} or, for bytes that are not valid UTF-8, {"hex": "..."}.
// The ids mode encodes with encode_batch and also one text at a time, and exits 1 if the
// two differ. TOKENIZER is anything load_tokenizer accepts. Errors go to stderr, exit 1.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "data/tokenizer.h"

namespace {

std::string from_hex(const std::string& hex) {
  if (hex.size() % 2) FORGE_FAIL("odd-length hex string");
  std::string bytes;
  for (size_t i = 0; i < hex.size(); i += 2) bytes += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return bytes;
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : bytes) hex += digits[c >> 4], hex += digits[c & 15];
  return hex;
}

std::vector<std::string> read_texts(const std::string& file) {
  std::ifstream in(file);
  if (!in) FORGE_FAIL("{}: cannot open", file);
  std::vector<std::string> texts;
  std::string line;
  for (int line_number = 1; std::getline(in, line); ++line_number) {
    if (line.empty()) continue;
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_object() && record.contains("text") && record["text"].is_string()) {
      texts.push_back(record["text"].get<std::string>());
    } else if (record.is_object() && record.contains("hex") && record["hex"].is_string()) {
      texts.push_back(from_hex(record["hex"].get<std::string>()));
    } else {
      FORGE_FAIL("{}:{}: expected {{\"text\": ...}} or {{\"hex\": ...}}", file, line_number);
    }
  }
  return texts;
}

nlohmann::json optional_id(std::optional<int32_t> id) { return id ? nlohmann::json(*id) : nlohmann::json(); }

int decode_lines(const forge::Tokenizer& tokenizer, const std::string& file) {
  std::ifstream in(file);
  if (!in) FORGE_FAIL("{}: cannot open", file);
  std::string line;
  for (int line_number = 1; std::getline(in, line); ++line_number) {
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (!record.is_object() || !record.contains("ids") || !record["ids"].is_array())
      FORGE_FAIL("{}:{}: expected {{\"ids\": [...]}}", file, line_number);
    const nlohmann::json decoded{{"decoded_hex", to_hex(tokenizer.decode(record["ids"].get<std::vector<int32_t>>()))}};
    std::printf("%s\n", decoded.dump().c_str());
  }
  return 0;
}

int run(int argc, char** argv) {
  const std::string mode = argc > 1 && std::string(argv[1]).starts_with("--") ? argv[1] : "";
  const int first = mode.empty() ? 1 : 2;
  if ((mode == "--info" && argc != 3) || (mode != "--info" && argc != first + 2) ||
      (!mode.empty() && mode != "--info" && mode != "--bench" && mode != "--decode")) {
    std::fprintf(stderr, "usage: forge_tokenize [--info | --bench | --decode] TOKENIZER [TEXTS.jsonl | IDS.jsonl]\n");
    return 2;
  }
  const auto tokenizer = forge::load_tokenizer(argv[first]);
  if (mode == "--info") {
    nlohmann::json info{{"vocab_size", tokenizer->vocab_size()},
                        {"bos_id", optional_id(tokenizer->bos_id())},
                        {"eos_id", optional_id(tokenizer->eos_id())}};
    std::printf("%s\n", info.dump().c_str());
    return 0;
  }
  if (mode == "--decode") return decode_lines(*tokenizer, argv[first + 1]);
  const auto texts = read_texts(argv[first + 1]);
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  if (mode == "--bench") {
    const auto start = std::chrono::steady_clock::now();
    const auto ids = tokenizer->encode_batch(views);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    size_t bytes = 0, tokens = 0;
    for (const auto& text : texts) bytes += text.size();
    for (const auto& document : ids) tokens += document.size();
    nlohmann::json result{{"bytes", bytes}, {"tokens", tokens}, {"seconds", seconds}, {"threads", forge::num_threads()}};
    std::printf("%s\n", result.dump().c_str());
    return 0;
  }
  const auto batch = tokenizer->encode_batch(views);
  for (size_t i = 0; i < texts.size(); ++i) {
    if (tokenizer->encode(texts[i]) != batch[i]) {
      std::fprintf(stderr, "text %zu: encode_batch differs from encode\n", i);
      return 1;
    }
    nlohmann::json line{{"ids", batch[i]}, {"decoded_hex", to_hex(tokenizer->decode(batch[i]))}};
    std::printf("%s\n", line.dump().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const forge::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
