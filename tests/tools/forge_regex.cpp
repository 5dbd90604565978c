// forge_regex: splits texts with tokenizer regexes as forge translates and runs them, for
// tests/python/test_tokenizer_regex_vs_hf.py to compare with tokenizers' Split pre-tokenizer.
//   forge_regex REQUESTS.jsonl
// Each request line is {"pattern": "...", "behavior": "isolated", "text": "..."} (or
// "text_file": PATH instead of "text"); behavior is one of removed, isolated,
// merged_with_previous, merged_with_next, contiguous, as tokenizers' Python API names them.
// Each answer line is {"pieces": [[begin, end], ...]} in code point offsets, as
// pre_tokenize_str gives them, or {"error": "..."} when forge refuses the pattern.
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.h"
#include "data/tokenizer_regex.h"
#include "data/tokenizer_split.h"
#include "data/utf8.h"

namespace {

forge::SplitBehavior behavior_named(const std::string& name) {
  static const std::map<std::string, forge::SplitBehavior> behaviors{
      {"removed", forge::SplitBehavior::Removed},
      {"isolated", forge::SplitBehavior::Isolated},
      {"merged_with_previous", forge::SplitBehavior::MergedWithPrevious},
      {"merged_with_next", forge::SplitBehavior::MergedWithNext},
      {"contiguous", forge::SplitBehavior::Contiguous}};
  auto it = behaviors.find(name);
  if (it == behaviors.end()) FORGE_FAIL("unknown behavior '{}'", name);
  return it->second;
}

const std::string& file_text(const std::string& path) {
  static std::map<std::string, std::string> texts;
  auto it = texts.find(path);
  if (it != texts.end()) return it->second;
  std::ifstream in(path, std::ios::binary);
  if (!in) FORGE_FAIL("{}: cannot open", path);
  std::ostringstream content;
  content << in.rdbuf();
  return texts.emplace(path, content.str()).first->second;
}

nlohmann::json pieces_in_code_points(const std::string& text, const std::vector<forge::ByteRange>& pieces) {
  nlohmann::json out = nlohmann::json::array();
  size_t byte = 0, code_points = 0;
  auto advance_to = [&](size_t target) {
    for (; byte < target; ++code_points) byte += forge::utf8::unit_length(text, byte);
    return code_points;
  };
  for (const auto& [begin, end] : pieces) {
    const size_t first = advance_to(begin);
    out.push_back({first, advance_to(end)});
  }
  return out;
}

int run(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: forge_regex REQUESTS.jsonl\n");
    return 2;
  }
  std::ifstream in(argv[1]);
  if (!in) FORGE_FAIL("{}: cannot open", argv[1]);
  std::string line;
  while (std::getline(in, line)) {
    const auto request = nlohmann::json::parse(line);
    const std::string text = request.contains("text") ? request["text"].get<std::string>()
                                                      : file_text(request["text_file"].get<std::string>());
    nlohmann::json answer;
    try {
      const forge::TokenizerRegex regex(request["pattern"].get<std::string>(), "request", "pattern");
      answer["pieces"] = pieces_in_code_points(
          text, forge::split_ranges(text, regex.find_all(text), behavior_named(request["behavior"]), false));
    } catch (const forge::Error& e) {
      answer["error"] = e.what();
    }
    std::printf("%s\n", answer.dump().c_str());
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
  } catch (const nlohmann::json::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
