// CLIP's tokenizer; see clip_tokenizer.h (NOTE [CLIP tokenizer]).
#include "data/clip_tokenizer.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "core/error.h"
#include "core/input_file.h"
#include "core/json_input.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// CLIPTokenizer's split pattern (transformers 5, models/clip/tokenization_clip.py).
constexpr const char* kSplitPattern =
    R"(<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+)";

// transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order, with CLIPTokenizer's defaults.
struct NamedToken {
  const char* key;
  const char* fallback;  // null: none
};
constexpr std::array<NamedToken, 7> kNamedTokens = {{{"bos_token", "<|startoftext|>"},
                                                      {"eos_token", "<|endoftext|>"},
                                                      {"unk_token", "<|endoftext|>"},
                                                      {"sep_token", nullptr},
                                                      {"pad_token", "<|endoftext|>"},
                                                      {"cls_token", nullptr},
                                                      {"mask_token", nullptr}}};

// An added token as transformers holds it: a tokenizers AddedToken, or a plain string (which
// compares equal only to the same string, and becomes a special, unnormalized token).
struct Token {
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = true;
  bool plain = true;
  bool operator==(const Token&) const = default;
};

// An AddedToken object: content and flags; normalized defaults to !special (tokenizers').
Token token_object(const json& value, bool special_default, const std::string& file, const std::string& where) {
  Token t;
  t.plain = false;
  auto flag = [&](const char* key, bool fallback) {
    if (!value.contains(key) || value[key].is_null()) return fallback;
    if (!value[key].is_boolean())
      FORGE_FAIL("{}: {}.{} is {}, expected true or false", file, where, key, describe_json(value[key]));
    return value[key].get<bool>();
  };
  if (!value.contains("content") || !value["content"].is_string() || value["content"].get<std::string>().empty())
    FORGE_FAIL("{}: {} needs a non-empty string \"content\"", file, where);
  t.content = value["content"].get<std::string>();
  t.special = flag("special", special_default);
  t.single_word = flag("single_word", false);
  t.lstrip = flag("lstrip", false);
  t.rstrip = flag("rstrip", false);
  t.normalized = flag("normalized", !t.special);
  return t;
}

Token plain_token(const std::string& content) {
  Token t;
  t.content = content;
  return t;
}

// A named token's value in tokenizer_config.json (a string, or an AddedToken object marked
// "__type": "AddedToken") or special_tokens_map.json (a string or an object, special).
std::optional<Token> named_token(const json& value, bool from_special_map, const std::string& file,
                                 const std::string& key) {
  if (value.is_null()) return std::nullopt;
  if (value.is_string()) {
    if (value.get<std::string>().empty()) FORGE_FAIL("{}: \"{}\" is an empty string, expected a token", file, key);
    return plain_token(value.get<std::string>());
  }
  if (value.is_object() && (from_special_map || value.value("__type", "") == "AddedToken"))
    return token_object(value, from_special_map, file, "\"" + key + "\"");
  FORGE_FAIL("{}: \"{}\" is {}, expected a token string{}", file, key, describe_json(value),
             from_special_map ? " or object" : " or an object with \"__type\": \"AddedToken\"");
}

json read_json_object(const fs::path& path, const char* what) {
  json j = read_json_file(path.string(), what);
  if (!j.is_object()) FORGE_FAIL("{}: expected a JSON object, got {}", path.string(), describe_json(j));
  return j;
}

// The folder holding the tokenizer's files.
std::string tokenizer_folder(const std::string& path) {
  std::error_code error;
  FORGE_CHECK(fs::is_directory(path, error),
              "CLIP tokenizer '{}' is not a directory: expected a CLIP tokenizer folder (FLUX.1's tokenizer/) or a "
              "folder holding one as tokenizer/",
              path);
  const fs::path dir = path;
  auto has_files = [&](const fs::path& d) {
    return fs::exists(d / "tokenizer.json") || fs::exists(d / "vocab.json") || fs::exists(d / "merges.txt");
  };
  if (has_files(dir)) return dir.string();
  if (fs::is_directory(dir / "tokenizer", error) && has_files(dir / "tokenizer")) return (dir / "tokenizer").string();
  FORGE_FAIL("'{}' holds neither vocab.json and merges.txt, nor tokenizer.json, nor a tokenizer/ folder with them",
             path);
}

// vocab.json: {"token": id, ...}, ids non-negative 32-bit integers.
json read_vocab(const fs::path& path) {
  json vocab = read_json_object(path, "the CLIP tokenizer's vocab.json");
  for (const auto& [token, id] : vocab.items())
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      FORGE_FAIL("{}: the id of token '{}' is {}, expected a non-negative 32-bit integer", path.string(), token,
                 describe_json(id));
  return vocab;
}

// merges.txt as tokenizers' BPE::read_file reads it: lines (a final newline ends the last
// one), "#version..." lines skipped, every other line two tokens split by one space, both
// and their concatenation in the vocab.
json read_merges(const fs::path& path, const json& vocab) {
  const std::string text = read_regular_file(path.string(), "the CLIP tokenizer's merges.txt");
  json merges = json::array();
  size_t line_number = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.starts_with("#version")) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
      FORGE_FAIL("{}:{}: expected two tokens separated by one space, got '{}'", path.string(), line_number, line);
    const std::string left = line.substr(0, space), right = line.substr(space + 1);
    for (const std::string& token : {left, right, left + right})
      if (!vocab.contains(token))
        FORGE_FAIL("{}:{}: the merge '{}' needs token '{}', which vocab.json lacks", path.string(), line_number, line,
                   token);
    merges.push_back(json::array({left, right}));
  }
  return merges;
}

json split_pattern_pre_tokenizer() {
  return {{"type", "Sequence"},
          {"pretokenizers",
           json::array({{{"type", "Split"},
                         {"pattern", {{"Regex", kSplitPattern}}},
                         {"behavior", "Removed"},
                         {"invert", true}},
                        {{"type", "ByteLevel"},
                         {"add_prefix_space", false},
                         {"trim_offsets", true},
                         {"use_regex", true}}})}};
}

json clip_normalizer() {
  return {{"type", "Sequence"},
          {"normalizers", json::array({{{"type", "NFC"}},
                                       {{"type", "Replace"}, {"pattern", {{"Regex", "\\s+"}}}, {"content", " "}},
                                       {{"type", "Lowercase"}}})}};
}

}  // namespace

ClipTokenizer::ClipTokenizer(const std::string& path) : folder_(tokenizer_folder(path)) {
  const fs::path dir = folder_;
  const fs::path tokenizer_json = dir / "tokenizer.json", config_path = dir / "tokenizer_config.json",
                 special_map_path = dir / "special_tokens_map.json";
  if (fs::exists(dir / "added_tokens.json"))
    FORGE_FAIL("{}: added_tokens.json (legacy added tokens) is not supported by forge's CLIP tokenizer",
               (dir / "added_tokens.json").string());

  // Vocab and merges (NOTE [CLIP tokenizer]).
  json vocab, merges;
  std::string model_file;
  json file_added_tokens;
  if (fs::exists(tokenizer_json)) {
    model_file = tokenizer_json.string();
    const json j = read_json_object(tokenizer_json, "the CLIP tokenizer's tokenizer.json");
    const TokenizerJsonReader reader(model_file);
    if (!j.contains("model") || !j["model"].is_object()) reader.fail("top level", "missing 'model' (an object)");
    const std::string type = reader.string_or(j["model"], "model", "type", "BPE");
    if (type != "BPE") reader.fail("model", fmt::format("type '{}' is not a CLIP tokenizer's (expected BPE)", type));
    vocab = reader.object(j["model"], "model", "vocab");
    if (!j["model"].contains("merges") || !j["model"]["merges"].is_array())
      reader.fail("model", "missing 'merges' (a list)");
    merges = j["model"]["merges"];
    if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
      if (!j["added_tokens"].is_array()) reader.fail("added_tokens", "expected a list");
      file_added_tokens = j["added_tokens"];
    }
  } else {
    for (const char* name : {"vocab.json", "merges.txt"})
      if (!fs::exists(dir / name))
        FORGE_FAIL("{}: no {} (a CLIP tokenizer needs vocab.json and merges.txt, or tokenizer.json)", folder_, name);
    model_file = (dir / "vocab.json").string();
    vocab = read_vocab(dir / "vocab.json");
    merges = read_merges(dir / "merges.txt", vocab);
  }

  // Special tokens, resolved as transformers 5 resolves them.
  const json config = fs::exists(config_path) ? read_json_object(config_path, "tokenizer_config.json") : json::object();
  const std::string config_file = config_path.string();
  for (const char* key : {"padding_side", "truncation_side"})
    if (config.contains(key) && config[key] != "right")
      FORGE_FAIL("{}: \"{}\" is {}; FluxPipeline's CLIP captions are padded and truncated on the right", config_file,
                 key, describe_json(config[key]));
  std::vector<std::pair<int64_t, Token>> decoder;
  bool have_decoder = false;
  if (config.contains("added_tokens_decoder")) {
    have_decoder = true;
    const json& entries = config["added_tokens_decoder"];
    if (!entries.is_object()) FORGE_FAIL("{}: \"added_tokens_decoder\" is {}, expected an object", config_file,
                                         describe_json(entries));
    for (const auto& [id, value] : entries.items()) {
      const std::string where = "added_tokens_decoder[\"" + id + "\"]";
      int64_t number = -1;
      try {
        size_t used = 0;
        number = std::stoll(id, &used);
        if (used != id.size()) number = -1;
      } catch (const std::exception&) {
        number = -1;
      }
      if (number < 0 || number > INT32_MAX) FORGE_FAIL("{}: {}: the key must be a token id", config_file, where);
      if (!value.is_object()) FORGE_FAIL("{}: {} is {}, expected an object", config_file, where, describe_json(value));
      decoder.emplace_back(number, token_object(value, false, config_file, where));
    }
  }
  std::map<std::string, std::pair<json, std::string>> named_values;  // key -> (value, file)
  for (const NamedToken& named : kNamedTokens)
    if (config.contains(named.key)) named_values[named.key] = {config[named.key], config_file};
  for (const char* key : {"additional_special_tokens", "extra_special_tokens"})
    if (config.contains(key) && !config[key].is_null() && !config[key].empty())
      FORGE_FAIL("{}: \"{}\" is set; forge's CLIP tokenizer takes no special tokens beyond bos, eos, unk and pad",
                 config_file, key);
  if (!have_decoder) {
    if (fs::exists(special_map_path)) {
      const json map = read_json_object(special_map_path, "special_tokens_map.json");
      for (const auto& item : map.items()) {
        const std::string key = item.key();  // a variable, not a structured binding: lambdas capture it (clang)
        const json& value = item.value();
        const bool named = std::any_of(kNamedTokens.begin(), kNamedTokens.end(),
                                       [&](const NamedToken& n) { return key == n.key; });
        if (named) {
          named_values[key] = {value, special_map_path.string()};
        } else if (!value.is_null() && !value.empty()) {
          FORGE_FAIL("{}: \"{}\" is set; forge's CLIP tokenizer takes no special tokens beyond bos, eos, unk and pad",
                     special_map_path.string(), key);
        }
      }
    }
    for (size_t i = 0; i < file_added_tokens.size(); ++i) {
      const std::string where = fmt::format("added_tokens[{}]", i);
      const json& entry = file_added_tokens[i];
      if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_number_integer())
        FORGE_FAIL("{}: {} needs an integer \"id\"", model_file, where);
      decoder.emplace_back(entry["id"].get<int64_t>(), token_object(entry, false, model_file, where));
    }
  }
  std::sort(decoder.begin(), decoder.end(), [](const auto& a, const auto& b) { return a.first < b.first; });

  std::vector<std::optional<Token>> named(kNamedTokens.size());
  for (size_t i = 0; i < kNamedTokens.size(); ++i) {
    auto it = named_values.find(kNamedTokens[i].key);
    if (it == named_values.end()) {
      if (kNamedTokens[i].fallback) named[i] = plain_token(kNamedTokens[i].fallback);
      continue;
    }
    const std::string& file = it->second.second;
    named[i] = named_token(it->second.first, file == special_map_path.string(), file, kNamedTokens[i].key);
  }
  std::vector<Token> to_add;
  std::set<std::string> decoder_contents;
  for (const auto& [id, token] : decoder) {
    to_add.push_back(token);
    decoder_contents.insert(token.content);
  }
  for (const auto& token : named) {
    if (!token || decoder_contents.contains(token->content)) continue;
    if (std::find(to_add.begin(), to_add.end(), *token) != to_add.end()) continue;
    to_add.push_back(*token);
  }
  // Added in order; a later token with the same text replaces the flags of an earlier one.
  std::map<std::string, Token> added;
  std::vector<std::string> order;
  for (Token token : to_add) {
    token.special = true;
    if (token.plain) token.normalized = false;
    if (!added.contains(token.content)) order.push_back(token.content);
    added[token.content] = token;
  }
  for (const auto& [id, token] : decoder) {
    const auto it = vocab.find(token.content);
    if (it == vocab.end() || it->get<int64_t>() != id)
      FORGE_FAIL("{}: added token '{}' has id {}, but the vocab ({}) {}", have_decoder ? config_file : model_file,
                 token.content, id, model_file,
                 it == vocab.end() ? std::string("lacks it") : fmt::format("gives it id {}", it->get<int64_t>()));
  }
  json added_tokens = json::array();
  for (const std::string& content : order) {
    const Token& t = added[content];
    const auto it = vocab.find(content);
    if (it == vocab.end())
      FORGE_FAIL("{}: special token '{}' is not in the vocab ({}); forge's CLIP tokenizer adds no tokens of its own",
                 config_file, content, model_file);
    added_tokens.push_back({{"id", it->get<int64_t>()},
                            {"content", content},
                            {"single_word", t.single_word},
                            {"lstrip", t.lstrip},
                            {"rstrip", t.rstrip},
                            {"normalized", t.normalized},
                            {"special", true}});
  }
  auto id_of = [&](size_t index, const char* what) {
    const std::optional<Token>& token = named[index];
    if (!token) FORGE_FAIL("{}: \"{}\" is null; a CLIP tokenizer needs {}", config_file, kNamedTokens[index].key, what);
    const auto it = vocab.find(token->content);
    if (it == vocab.end())
      FORGE_FAIL("{}: \"{}\" '{}' is not in the vocab ({})", config_file, kNamedTokens[index].key, token->content,
                 model_file);
    return static_cast<int32_t>(it->get<int64_t>());
  };
  bos_id_ = id_of(0, "a start token");
  eos_id_ = id_of(1, "an end token");
  id_of(2, "an unknown token");
  pad_id_ = id_of(4, "a padding token");

  const std::string bos = named[0]->content, eos = named[1]->content;
  json pipeline = {
      {"added_tokens", added_tokens},
      {"normalizer", clip_normalizer()},
      {"pre_tokenizer", split_pattern_pre_tokenizer()},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                {{"SpecialToken", {{"id", eos}, {"type_id", 0}}}}})}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", named[2]->content},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", "</w>"},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", std::move(vocab)},
        {"merges", std::move(merges)}}}};
  tokenizer_ = std::make_unique<HfTokenizer>(pipeline, model_file);
}

std::vector<int32_t> ClipTokenizer::encode(std::string_view text) const { return tokenizer_->encode(text); }

std::vector<int32_t> ClipTokenizer::encode_padded(std::string_view text, int64_t length) const {
  return encode_padded_batch({std::string(text)}, length);
}

std::vector<int32_t> ClipTokenizer::encode_padded_batch(const std::vector<std::string>& texts, int64_t length) const {
  FORGE_CHECK(length >= 2, "CLIP tokenizer: a padded caption needs room for its start and end tokens, got length {}",
              length);
  const std::vector<std::string_view> views(texts.begin(), texts.end());
  const std::vector<std::vector<int32_t>> encoded = tokenizer_->encode_batch(views);
  std::vector<int32_t> out;
  out.reserve(texts.size() * static_cast<size_t>(length));
  for (const std::vector<int32_t>& ids : encoded) {
    const size_t row = out.size();
    const int64_t kept = std::min<int64_t>(static_cast<int64_t>(ids.size()), length - 2);
    out.push_back(bos_id_);
    out.insert(out.end(), ids.begin(), ids.begin() + kept);
    out.push_back(eos_id_);
    out.resize(row + static_cast<size_t>(length), pad_id_);
  }
  return out;
}

}  // namespace forge
