// TiktokenTokenizer: builds the converted tokenizer.json's parts from a tiktoken file; see
// tiktoken_tokenizer.h, NOTE [tiktoken as tokenizer.json] and NOTE [Llama 3 special tokens].
#include "data/tiktoken_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <tuple>
#include <unordered_map>

#include "core/error.h"
#include "core/json_input.h"
#include "data/byte_level.h"
#include "data/tiktoken_bpe_file.h"

namespace forge {
namespace {

constexpr const char* kLlama3SplitPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr size_t kSpecialTokenCount = 256;

std::string reserved(int index) { return fmt::format("<|reserved_special_token_{}|>", index); }

// Meta's names for Llama 3, in id order (NOTE [Llama 3 special tokens]).
std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> names = {"<|begin_of_text|>",   "<|end_of_text|>",   reserved(0), reserved(1),
                                    reserved(2),           reserved(3),         "<|start_header_id|>",
                                    "<|end_header_id|>",   reserved(4),         "<|eot_id|>"};
  for (int index = 5; names.size() < kSpecialTokenCount; ++index) names.push_back(reserved(index));
  return names;
}

// Hugging Face's names for Llama 3.1 and later, in id order (NOTE [Llama 3 special tokens]).
std::vector<std::string> llama31_special_tokens() {
  std::vector<std::string> names = {"<|begin_of_text|>",         "<|end_of_text|>",
                                    reserved(0),                 reserved(1),
                                    "<|finetune_right_pad_id|>", reserved(2),
                                    "<|start_header_id|>",       "<|end_header_id|>",
                                    "<|eom_id|>",                "<|eot_id|>",
                                    "<|python_tag|>"};
  for (int index = 3; names.size() < kSpecialTokenCount; ++index) names.push_back(reserved(index));
  return names;
}

// Whether the params.json beside `file` marks a Llama 3.1 or later model; see NOTE [Llama 3 special tokens].
bool beside_llama31_params(const std::string& file) {
  const auto params_path = std::filesystem::path(file).parent_path() / "params.json";
  if (!std::filesystem::is_regular_file(params_path)) return false;
  nlohmann::json params;
  try {
    params = read_json_file(params_path.string(), "params.json");
  } catch (const Error& e) {
    FORGE_FAIL("{}: not a JSON object (forge reads its use_scaled_rope to name the special tokens of {}): {}",
               params_path.string(), file, e.what());
  }
  if (!params.is_object())
    FORGE_FAIL("{}: not a JSON object (forge reads its use_scaled_rope to name the special tokens of {})",
               params_path.string(), file);
  const auto scaled_rope = params.find("use_scaled_rope");
  return scaled_rope != params.end() && scaled_rope->is_boolean() && scaled_rope->get<bool>();
}

// The merges Hugging Face's TikTokenConverter derives from the ranks, in its order: for
// each token by rank, every cut into two tokens, by the ranks of the left and right parts.
std::vector<BpeMerge> merges_of_ranks(const std::vector<std::string>& bytes_of_rank) {
  std::unordered_map<std::string_view, int32_t> rank_of;
  rank_of.reserve(bytes_of_rank.size());
  for (size_t rank = 0; rank < bytes_of_rank.size(); ++rank) rank_of.emplace(bytes_of_rank[rank], rank);
  std::vector<BpeMerge> merges, cuts;
  for (size_t rank = 0; rank < bytes_of_rank.size(); ++rank) {
    const std::string_view token = bytes_of_rank[rank];
    cuts.clear();
    for (size_t cut = 1; cut < token.size(); ++cut) {
      const auto left = rank_of.find(token.substr(0, cut));
      if (left == rank_of.end()) continue;
      const auto right = rank_of.find(token.substr(cut));
      if (right != rank_of.end()) cuts.push_back({left->second, right->second, static_cast<int32_t>(rank)});
    }
    std::sort(cuts.begin(), cuts.end(), [](const BpeMerge& a, const BpeMerge& b) {
      return std::tie(a.left, a.right) < std::tie(b.left, b.right);
    });
    merges.insert(merges.end(), cuts.begin(), cuts.end());
  }
  return merges;
}

// The pre-tokenizer TikTokenConverter writes into tokenizer.json.
nlohmann::json converted_pre_tokenizer() {
  const nlohmann::json split = {
      {"type", "Split"}, {"pattern", {{"Regex", kLlama3SplitPattern}}}, {"behavior", "Isolated"}, {"invert", false}};
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  return {{"type", "Sequence"}, {"pretokenizers", {split, byte_level}}};
}

}  // namespace

TiktokenTokenizer::TiktokenTokenizer(const std::string& file) {
  token_bytes_ = read_tiktoken_bpe(file);
  const auto rank_count = static_cast<int32_t>(token_bytes_.size());
  TokenIdMap vocab;
  vocab.reserve(token_bytes_.size());
  for (int32_t rank = 0; rank < rank_count; ++rank) vocab.emplace(byte_level::encode(token_bytes_[rank]), rank);
  model_ = std::make_unique<BpeModel>(std::move(vocab), merges_of_ranks(token_bytes_), /*ignore_merges=*/true);
  pre_tokenizer_ = std::make_unique<PreTokenizer>(converted_pre_tokenizer(), TokenizerJsonReader(file));

  std::vector<AddedToken> specials;
  for (const auto& name : beside_llama31_params(file) ? llama31_special_tokens() : llama3_special_tokens()) {
    const auto id = static_cast<int32_t>(token_bytes_.size());
    specials.push_back({.id = id, .content = name, .matched_content = name, .special = true});
    token_bytes_.push_back(name);
  }
  special_tokens_ = std::make_unique<AddedTokenMatcher>(std::move(specials));
  bos_id_ = rank_count;
  eos_id_ = rank_count + 1;
}

std::vector<int32_t> TiktokenTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  std::vector<PreToken> words;
  for (const auto& segment : special_tokens_->split(text)) {
    if (segment.token_id >= 0) {
      ids.push_back(segment.token_id);
      continue;
    }
    words.clear();
    words.push_back({std::string(text.substr(segment.begin, segment.end - segment.begin)), segment.begin == 0});
    pre_tokenizer_->pre_tokenize(words);
    for (const auto& word : words) model_->tokenize(word.text, ids);
  }
  return ids;
}

std::string TiktokenTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) FORGE_FAIL("decode: token id {} is not in the vocab (size {})", id, vocab_size());
    text += token_bytes_[id];
  }
  return text;
}

}  // namespace forge
