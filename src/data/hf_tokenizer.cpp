#include "data/hf_tokenizer.h"

#include <filesystem>

#include "core/error.h"
#include "core/json_input.h"

namespace forge {
namespace {

const nlohmann::json& member_or_null(const nlohmann::json& config, const char* key) {
  static const nlohmann::json null_value;
  auto it = config.find(key);
  return it == config.end() ? null_value : *it;
}

// The special token before and after "$A" in a TemplateProcessing's "single" template.
void template_bos_eos(const nlohmann::json& processor, std::optional<std::string>& bos,
                      std::optional<std::string>& eos) {
  if (!processor.is_object()) return;
  const std::string type = processor.value("type", "");
  if (type == "Sequence" && processor.contains("processors") && processor["processors"].is_array()) {
    for (const auto& p : processor["processors"]) template_bos_eos(p, bos, eos);
    return;
  }
  if (type != "TemplateProcessing" || !processor.contains("single") || !processor["single"].is_array()) return;
  bool seen_sequence = false;
  for (const auto& piece : processor["single"]) {
    if (piece.contains("Sequence")) {
      seen_sequence = true;
    } else if (piece.contains("SpecialToken") && piece["SpecialToken"].contains("id") &&
               piece["SpecialToken"]["id"].is_string()) {
      (seen_sequence ? eos : bos) = piece["SpecialToken"]["id"].get<std::string>();
    }
  }
}

// bos_token / eos_token of tokenizer_config.json: a string or {"content": ...}.
std::optional<std::string> config_token(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return std::nullopt;
}

constexpr int64_t kMaxUnusedIds = int64_t{1} << 20;

// Where the id came from, for the message: "model.vocab" or "added_tokens".
std::string max_id_owner(const nlohmann::json& config, int32_t max_id) {
  const auto& list = member_or_null(config, "added_tokens");
  if (list.is_array())
    for (const auto& token : list)
      if (token.is_object() && token.contains("id") && token["id"] == max_id) return "added_tokens";
  return "model.vocab";
}

}  // namespace

HfTokenizer::HfTokenizer(const nlohmann::json& config, const std::string& file) {
  TokenizerJsonReader reader(file);
  if (!config.is_object()) reader.fail("top level", "expected a JSON object");
  const auto& model = member_or_null(config, "model");
  if (model.is_null()) reader.fail("top level", "missing 'model'");
  const std::string model_type = reader.string_or(model, "model", "type", "BPE");
  if (model_type != "BPE") reader.fail("model", fmt::format("type '{}' is not supported (supported: BPE)", model_type));
  model_ = std::make_unique<BpeModel>(model, reader);
  normalizer_ = std::make_unique<Normalizer>(member_or_null(config, "normalizer"), reader);
  pre_tokenizer_ = std::make_unique<PreTokenizer>(member_or_null(config, "pre_tokenizer"), reader);
  decoder_ = std::make_unique<Decoder>(member_or_null(config, "decoder"), reader);

  int32_t max_id = -1;
  for (const auto& [token, id] : model_->vocab()) max_id = std::max(max_id, id);
  read_added_tokens(config, reader);
  for (const auto& token : added_tokens_) max_id = std::max(max_id, token.id);
  // NOTE [Token ids are checked against the vocabulary]
  // The id → token table is indexed by id, so its size is the largest id, not the number
  // of tokens: one id near 2^31 in a ten-token file would allocate tens of GB. Real
  // tokenizers number their tokens densely (added tokens continue the model's ids), so
  // forge refuses ids more than kMaxUnusedIds past the number of tokens the file defines.
  const int64_t defined = static_cast<int64_t>(model_->vocab().size() + added_tokens_.size());
  if (max_id >= defined + kMaxUnusedIds)
    reader.fail(max_id_owner(config, max_id),
                fmt::format("token id {} is far beyond the {} tokens the file defines (ids must stay below {})", max_id,
                            defined, defined + kMaxUnusedIds));
  id_to_token_.assign(static_cast<size_t>(max_id) + 1, std::string());
  id_known_.assign(max_id + 1, false);
  for (const auto& [token, id] : model_->vocab()) id_to_token_[id] = token, id_known_[id] = true;
  for (const auto& token : added_tokens_) id_to_token_[token.id] = token.matched_content, id_known_[token.id] = true;
  find_bos_eos(config, reader, file);
}

void HfTokenizer::read_added_tokens(const nlohmann::json& config, const TokenizerJsonReader& reader) {
  const auto& list = member_or_null(config, "added_tokens");
  if (list.is_null()) return;
  if (!list.is_array()) reader.fail("added_tokens", "expected a list");
  std::vector<AddedToken> original, normalized;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = fmt::format("added_tokens[{}]", i);
    AddedToken token;
    const int64_t id = reader.integer(list[i], where, "id");
    if (id < 0 || id > INT32_MAX) reader.fail(where, "'id' must be a non-negative 32-bit integer");
    token.id = static_cast<int32_t>(id);
    token.content = reader.string(list[i], where, "content");
    if (token.content.empty()) reader.fail(where, "'content' must not be empty");
    token.single_word = reader.boolean_or(list[i], where, "single_word", false);
    token.lstrip = reader.boolean_or(list[i], where, "lstrip", false);
    token.rstrip = reader.boolean_or(list[i], where, "rstrip", false);
    token.special = reader.boolean_or(list[i], where, "special", false);
    token.normalized = reader.boolean_or(list[i], where, "normalized", !token.special);
    token.matched_content = token.content;
    if (token.normalized) normalizer_->normalize(token.matched_content);
    (token.normalized ? normalized : original).push_back(token);
    added_tokens_.push_back(std::move(token));
  }
  original_text_tokens_ = std::make_unique<AddedTokenMatcher>(std::move(original));
  normalized_text_tokens_ = std::make_unique<AddedTokenMatcher>(std::move(normalized));
}

std::optional<int32_t> HfTokenizer::token_id(std::string_view token) const {
  for (const auto& added : added_tokens_)
    if (added.content == token) return added.id;
  return model_->token_id(token);
}

void HfTokenizer::find_bos_eos(const nlohmann::json& config, const TokenizerJsonReader& reader,
                               const std::string& file) {
  std::optional<std::string> bos, eos;
  template_bos_eos(member_or_null(config, "post_processor"), bos, eos);

  const auto config_path = std::filesystem::path(file).parent_path() / "tokenizer_config.json";
  if ((!bos || !eos) && std::filesystem::is_regular_file(config_path)) {
    const nlohmann::json tokenizer_config = read_json_file(config_path.string(), "tokenizer_config.json");
    if (!tokenizer_config.is_object())
      FORGE_FAIL("{}: expected a JSON object, got {}", config_path.string(), describe_json(tokenizer_config));
    if (!bos) bos = config_token(tokenizer_config, "bos_token");
    if (!eos) eos = config_token(tokenizer_config, "eos_token");
  }
  auto known = [&](std::initializer_list<const char*> names) -> std::optional<std::string> {
    for (const char* name : names)
      for (const auto& added : added_tokens_)
        if (added.content == name) return added.content;
    return std::nullopt;
  };
  if (!bos) bos = known({"<|begin_of_text|>", "<s>", "<bos>"});
  if (!eos) eos = known({"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"});
  if (bos) {
    bos_id_ = token_id(*bos);
    if (!bos_id_) reader.fail("post_processor", fmt::format("BOS token '{}' is not in the vocab", *bos));
  }
  if (eos) {
    eos_id_ = token_id(*eos);
    if (!eos_id_) reader.fail("post_processor", fmt::format("EOS token '{}' is not in the vocab", *eos));
  }
}

void HfTokenizer::encode_normalized(std::string text, bool at_text_start, std::vector<int32_t>& ids) const {
  normalizer_->normalize(text);
  const auto segments = normalized_text_tokens_ ? normalized_text_tokens_->split(text)
                                                : std::vector<TextSegment>{{0, text.size(), -1}};
  std::vector<PreToken> words;
  for (const auto& segment : segments) {
    if (segment.token_id >= 0) {
      ids.push_back(segment.token_id);
      continue;
    }
    if (segment.begin == segment.end) continue;
    words.clear();
    words.push_back({text.substr(segment.begin, segment.end - segment.begin), at_text_start && segment.begin == 0});
    pre_tokenizer_->pre_tokenize(words);
    for (const auto& word : words) model_->tokenize(word.text, ids);
  }
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  if (text.empty()) return ids;
  const auto segments = original_text_tokens_ ? original_text_tokens_->split(text)
                                              : std::vector<TextSegment>{{0, text.size(), -1}};
  for (const auto& segment : segments) {
    if (segment.token_id >= 0) {
      ids.push_back(segment.token_id);
    } else {
      encode_normalized(std::string(text.substr(segment.begin, segment.end - segment.begin)), segment.begin == 0,
                        ids);
    }
  }
  return ids;
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size() || !id_known_[id])
      FORGE_FAIL("decode: token id {} is not in the vocab (size {})", id, vocab_size());
    tokens.push_back(id_to_token_[id]);
  }
  return decoder_->decode(std::move(tokens));
}

}  // namespace forge
