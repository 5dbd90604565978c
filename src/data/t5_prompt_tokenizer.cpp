// T5's prompt tokenization as transformers runs it; see t5_prompt_tokenizer.h
// and NOTE [T5 prompt tokens].
#include "data/t5_prompt_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_input.h"
#include "data/mapped_file.h"
#include "data/sentencepiece_model_proto.h"
#include "data/tiktoken_bpe_file.h"
#include "data/utf8.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kSpaceSymbol = "\xE2\x96\x81";  // U+2581 "▁", Metaspace's replacement
constexpr size_t kSpaceSymbolBytes = 3;
constexpr double kUnknownPenalty = 10.0;   // tokenizers' K_UNK_PENALTY
constexpr int64_t kDefaultExtraIds = 100;  // T5Tokenizer's extra_ids

// T5's special pieces, ids 0, 1, 2.
constexpr const char* kT5Specials[] = {"<pad>", "</s>", "<unk>"};

bool has_file(const fs::path& dir, const char* name) {
  std::error_code error;
  return fs::is_regular_file(dir / name, error);
}

// The tokenizer file `path` names (NOTE [T5 prompt tokens]: tokenizer.json
// before spiece.model).
std::string tokenizer_file(const std::string& path) {
  std::error_code error;
  if (!fs::is_directory(path, error)) return path;
  fs::path dir(path);
  if (!has_file(dir, "tokenizer.json") && !has_file(dir, "spiece.model") &&
      fs::is_directory(dir / "tokenizer_2", error))
    dir /= "tokenizer_2";
  if (has_file(dir, "tokenizer.json")) return (dir / "tokenizer.json").string();
  if (has_file(dir, "spiece.model")) return (dir / "spiece.model").string();
  FORGE_FAIL(
      "{}: no T5 tokenizer here: expected tokenizer.json or "
      "spiece.model (or a FLUX pipeline folder with "
      "them in tokenizer_2/)",
      path);
}

// tokenizer_config.json's extra_ids beside `file`, else T5Tokenizer's default.
int64_t extra_ids_beside(const std::string& file) {
  const fs::path config = fs::path(file).parent_path() / "tokenizer_config.json";
  if (!has_file(config.parent_path(), "tokenizer_config.json")) return kDefaultExtraIds;
  const json j = read_json_file(config.string(), "the tokenizer's tokenizer_config.json");
  if (!j.is_object() || !j.contains("extra_ids") || j["extra_ids"].is_null()) return kDefaultExtraIds;
  const json& v = j["extra_ids"];
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 100000)
    FORGE_FAIL("{}: \"extra_ids\" is {}, expected an integer from 0 to 100000", config.string(), describe_json(v));
  return v.get<int64_t>();
}

void check_t5_layout(const std::vector<std::string>& pieces, const std::string& file) {
  for (int32_t id = 0; id < 3; ++id)
    if (static_cast<size_t>(id) >= pieces.size() || pieces[static_cast<size_t>(id)] != kT5Specials[id])
      FORGE_FAIL(
          "{}: piece {} is '{}', T5's tokenizer has <pad>, </s>, <unk> "
          "as ids 0, 1, 2",
          file, id, static_cast<size_t>(id) < pieces.size() ? pieces[static_cast<size_t>(id)] : "(none)");
}

AddedToken special_token(int32_t id, std::string content, bool special = true) {
  AddedToken t;
  t.id = id;
  t.content = content;
  t.matched_content = std::move(content);
  t.special = special;
  return t;
}

// A component's "type" when it is an object with a string one, else "".
std::string type_of(const json& component) {
  return component.is_object() && component.contains("type") && component["type"].is_string()
             ? component["type"].get<std::string>()
             : std::string();
}

// Where text is not valid UTF-8, an error naming the byte offset.
void check_utf8(std::string_view text) {
  for (size_t pos = 0; pos < text.size(); pos += utf8::unit_length(text, pos))
    if (utf8::code_point_at(text, pos) < 0)
      FORGE_FAIL("T5 prompt: the text is not valid UTF-8 at byte {} (0x{:02X})", pos, static_cast<uint8_t>(text[pos]));
}

}  // namespace

T5PromptTokenizer::T5PromptTokenizer(const std::string& path) : file_(tokenizer_file(path)) {
  if (fs::path(file_).extension() == ".json")
    read_tokenizer_json(file_);
  else
    read_sentencepiece(file_, extra_ids_beside(file_));
}

T5PromptTokenizer::~T5PromptTokenizer() = default;

// transformers' SentencePieceExtractor: every piece with its score, then the
// sentinels <extra_id_{n-1}> .. <extra_id_0> (T5Converter); CONTROL and
// USER_DEFINED pieces become added tokens (matched in the raw text), as do
// <unk> and the sentinels.
void T5PromptTokenizer::read_sentencepiece(const std::string& file, int64_t extra_ids) {
  const MappedFile bytes(file);
  const SentencePieceModelProto model =
      parse_sentencepiece_model({reinterpret_cast<const char*>(bytes.data()), bytes.size()}, file);
  if (model.trainer_spec.model_type != SentencePieceModelType::Unigram)
    FORGE_FAIL(
        "{}: trainer_spec.model_type is not UNIGRAM; T5's tokenizer is "
        "a unigram model",
        file);
  std::vector<AddedToken> added;
  for (const SentencePiece& p : model.pieces) {
    const auto id = static_cast<int32_t>(pieces_.size());
    pieces_.push_back(p.piece);
    scores_.push_back(static_cast<double>(p.score));
    if (p.type == SentencePieceType::Control || p.type == SentencePieceType::UserDefined)
      added.push_back(special_token(id, p.piece, p.type == SentencePieceType::Control));
  }
  check_t5_layout(pieces_, file);
  added.push_back(special_token(kUnkId, kT5Specials[kUnkId]));
  for (int64_t i = extra_ids - 1; i >= 0; --i) {
    const auto id = static_cast<int32_t>(pieces_.size());
    pieces_.push_back("<extra_id_" + std::to_string(i) + ">");
    scores_.push_back(0.0);
    added.push_back(special_token(id, pieces_.back()));
  }
  if (!model.normalizer_spec.precompiled_charsmap.empty())
    charsmap_.emplace(model.normalizer_spec.precompiled_charsmap, file + ": normalizer_spec");
  finish(std::move(added));
}

// A tokenizer.json: model.vocab ([piece, score] pairs of a Unigram model), the
// Precompiled charsmap of its normalizer (alone or in a Sequence), its
// added_tokens, and a post-processor (if any) that appends </s> as T5's does.
// transformers 5 rebuilds the rest of the pipeline from the T5 class, as forge
// does.
void T5PromptTokenizer::read_tokenizer_json(const std::string& file) {
  const json j = read_json_file(file, "the T5 tokenizer.json");
  auto fail = [&](const std::string& where, const std::string& what) { FORGE_FAIL("{}: {}: {}", file, where, what); };
  if (!j.is_object()) fail("the file", "expected a JSON object");
  if (!j.contains("model") || !j["model"].is_object()) fail("model", "missing, expected an object");
  const json& model = j["model"];
  if (!model.contains("type") || model["type"] != "Unigram")
    fail("model.type", fmt::format("is {}, T5's tokenizer is \"Unigram\"",
                                   model.contains("type") ? describe_json(model["type"]) : "missing"));
  if (!model.contains("vocab") || !model["vocab"].is_array()) fail("model.vocab", "missing, expected a list");
  for (size_t i = 0; i < model["vocab"].size(); ++i) {
    const json& entry = model["vocab"][i];
    if (!entry.is_array() || entry.size() != 2 || !entry[0].is_string() || !entry[1].is_number())
      fail(fmt::format("model.vocab[{}]", i), fmt::format("is {}, expected [piece, score]", describe_json(entry)));
    pieces_.push_back(entry[0].get<std::string>());
    scores_.push_back(entry[1].get<double>());
  }
  check_t5_layout(pieces_, file);

  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const json& n = j["normalizer"];
    std::vector<const json*> steps{&n};
    if (type_of(n) == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array())
      for (const json& step : n["normalizers"]) steps.push_back(&step);
    for (const json* step : steps) {
      if (type_of(*step) != "Precompiled") continue;
      if (!step->contains("precompiled_charsmap") || (*step)["precompiled_charsmap"].is_null()) break;
      if (!(*step)["precompiled_charsmap"].is_string()) fail("normalizer.precompiled_charsmap", "expected a string");
      const std::string text = (*step)["precompiled_charsmap"].get<std::string>();
      if (text.empty()) break;
      const std::optional<std::string> blob = decode_base64(text);
      if (!blob) fail("normalizer.precompiled_charsmap", "is not base64");
      charsmap_.emplace(*blob, file + ": normalizer.precompiled_charsmap");
      break;
    }
  }

  std::vector<AddedToken> added;
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    if (!j["added_tokens"].is_array()) fail("added_tokens", "expected a list");
    for (size_t i = 0; i < j["added_tokens"].size(); ++i) {
      const json& t = j["added_tokens"][i];
      const std::string where = fmt::format("added_tokens[{}]", i);
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
          !t["content"].is_string() || t["content"].get<std::string>().empty())
        fail(where, fmt::format("is {}, expected {{\"id\": integer, "
                                "\"content\": non-empty string, ...}}",
                                describe_json(t)));
      const int64_t id = t["id"].get<int64_t>();
      if (id < 0 || id >= static_cast<int64_t>(pieces_.size()))
        fail(where + ".id", fmt::format("is {}, outside the vocabulary of {} pieces", id, pieces_.size()));
      auto flag = [&](const char* key) {
        if (!t.contains(key) || t[key].is_null()) return false;
        if (!t[key].is_boolean()) fail(where + "." + key, "expected true or false");
        return t[key].get<bool>();
      };
      if (flag("normalized"))
        fail(where, fmt::format("'{}' is matched in normalized text "
                                "(\"normalized\": true); T5's added tokens are "
                                "matched in the raw text",
                                t["content"].get<std::string>()));
      AddedToken token = special_token(static_cast<int32_t>(id), t["content"].get<std::string>(), flag("special"));
      token.single_word = flag("single_word");
      token.lstrip = flag("lstrip");
      token.rstrip = flag("rstrip");
      added.push_back(std::move(token));
    }
  }

  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    const json& p = j["post_processor"];
    const json single = json::array(
        {{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}});
    if (type_of(p) != "TemplateProcessing" || !p.contains("single") || p["single"] != single)
      fail("post_processor", "expected T5's TemplateProcessing, single [$A, </s>]");
  }
  finish(std::move(added));
}

// The Unigram model's trie and unknown score (tokenizers' Unigram::from), the
// added tokens.
void T5PromptTokenizer::finish(std::vector<AddedToken> added) {
  double lowest = std::numeric_limits<double>::infinity();
  for (size_t id = 0; id < pieces_.size(); ++id) {
    ids_[pieces_[id]] = static_cast<int32_t>(id);
    lowest = std::min(lowest, scores_[id]);
  }
  unknown_score_ = lowest - kUnknownPenalty;
  std::vector<std::pair<std::string, int32_t>> keys;
  for (const auto& [piece, id] : ids_)
    if (!piece.empty()) keys.emplace_back(piece, id);
  std::sort(keys.begin(), keys.end());
  trie_ = ByteTrie(std::move(keys));
  added_ = std::make_unique<AddedTokenMatcher>(std::move(added));
}

std::vector<int32_t> T5PromptTokenizer::encode(std::string_view text) const {
  check_utf8(text);
  std::vector<int32_t> ids;
  for (const TextSegment& s : added_->split(text)) {
    if (s.token_id >= 0)
      ids.push_back(s.token_id);
    else
      encode_text(text.substr(s.begin, s.end - s.begin), ids);
  }
  return ids;
}

std::vector<int32_t> T5PromptTokenizer::prompt_ids(std::string_view caption, int64_t max_length) const {
  FORGE_CHECK(max_length >= 1, "T5 prompt: max_length must be at least 1 (room for </s>), got {}", max_length);
  std::vector<int32_t> ids = encode(caption);
  if (static_cast<int64_t>(ids.size()) > max_length - 1) ids.resize(static_cast<size_t>(max_length - 1));
  ids.push_back(kEosId);
  ids.resize(static_cast<size_t>(max_length), kPadId);
  return ids;
}

// Steps 2 and 3 of NOTE [T5 prompt tokens] on text between added tokens, then
// each word.
void T5PromptTokenizer::encode_text(std::string_view text, std::vector<int32_t>& ids) const {
  std::string normalized;
  if (charsmap_) {
    normalized.reserve(text.size());
    for (size_t pos = 0; pos < text.size();) {
      const auto [length, replacement] = charsmap_->may_start_with(static_cast<uint8_t>(text[pos]))
                                             ? charsmap_->longest_match(text.substr(pos))
                                             : std::pair<size_t, std::string_view>{0, {}};
      if (length > 0) {
        normalized.append(replacement);
        pos += length;
      } else {
        const size_t unit = utf8::unit_length(text, pos);
        normalized.append(text.substr(pos, unit));
        pos += unit;
      }
    }
  } else {
    normalized.assign(text);
  }
  const std::string_view n(normalized);
  std::string word;
  for (size_t pos = 0; pos < n.size();) {
    while (pos < n.size() && utf8::is_whitespace(utf8::code_point_at(n, pos))) pos += utf8::unit_length(n, pos);
    if (pos == n.size()) break;
    size_t end = pos;
    while (end < n.size() && !utf8::is_whitespace(utf8::code_point_at(n, end))) end += utf8::unit_length(n, end);
    word.assign(n.substr(pos, end - pos));
    if (word.compare(0, kSpaceSymbolBytes, kSpaceSymbol) != 0) word.insert(0, kSpaceSymbol);
    // Split before every "▁" after the first (Metaspace's MergedWithNext).
    size_t begin = 0;
    for (size_t next = word.find(kSpaceSymbol, kSpaceSymbolBytes); next != std::string::npos;
         next = word.find(kSpaceSymbol, next + kSpaceSymbolBytes)) {
      encode_word(std::string_view(word).substr(begin, next - begin), ids);
      begin = next;
    }
    encode_word(std::string_view(word).substr(begin), ids);
    pos = end;
  }
}

// tokenizers' Unigram::encode_optimized on one word, then its tokens' ids.
void T5PromptTokenizer::encode_word(std::string_view word, std::vector<int32_t>& ids) const {
  struct Node {
    int32_t id = -1;
    double score = 0.0;
    int64_t start = -1;  // -1: no path ends here yet
  };
  std::vector<Node> best(word.size() + 1);
  best[0].start = 0;
  auto offer = [&](size_t start, size_t end, int32_t id, double score) {
    Node& node = best[end];
    const double candidate = best[start].score + score;
    if (node.start < 0 || candidate > node.score) node = {id, candidate, static_cast<int64_t>(start)};
  };
  for (size_t start = 0; start < word.size();) {
    const size_t char_length = utf8::unit_length(word, start);
    bool single_character = false;
    trie_.for_each_prefix(word.substr(start), [&](size_t length, int32_t id) {
      offer(start, start + length, id, scores_[static_cast<size_t>(id)]);
      single_character = single_character || length == char_length;
    });
    if (!single_character) offer(start, start + char_length, kUnkId, unknown_score_);
    start += char_length;
  }
  // Back from the end: the tokens, runs of <unk> nodes fused into one token.
  std::vector<std::pair<size_t, size_t>> tokens;  // byte ranges, last first
  bool in_unknown_run = false;
  for (size_t end = word.size(); end > 0;) {
    const Node& node = best[end];
    const auto start = static_cast<size_t>(node.start);
    if (node.id == kUnkId && in_unknown_run)
      tokens.back().first = start;
    else
      tokens.emplace_back(start, end);
    in_unknown_run = node.id == kUnkId;
    end = start;
  }
  for (auto it = tokens.rbegin(); it != tokens.rend(); ++it) {
    const auto found = ids_.find(word.substr(it->first, it->second - it->first));
    ids.push_back(found != ids_.end() ? found->second : kUnkId);
  }
}

}  // namespace forge
