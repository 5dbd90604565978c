#include "data/bpe_model.h"

#include <fmt/format.h>

#include <queue>

#include "data/utf8.h"

namespace forge {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

BpeModel::BpeModel(const nlohmann::json& model, const TokenizerJsonReader& reader) {
  const auto dropout = model.find("dropout");
  if (dropout != model.end() && !dropout->is_null() && !(dropout->is_number() && dropout->get<double>() == 0.0))
    reader.fail("model.dropout", "BPE dropout is random and not supported for encoding; expected null");
  if (!reader.string_or(model, "model", "continuing_subword_prefix", "").empty())
    reader.fail("model.continuing_subword_prefix", "is not supported (expected null, as in Llama tokenizers)");
  end_of_word_suffix_ = reader.string_or(model, "model", "end_of_word_suffix", "");
  fuse_unk_ = reader.boolean_or(model, "model", "fuse_unk", false);
  byte_fallback_ = reader.boolean_or(model, "model", "byte_fallback", false);
  ignore_merges_ = reader.boolean_or(model, "model", "ignore_merges", false);

  const auto& vocab = reader.object(model, "model", "vocab");
  vocab_.reserve(vocab.size());
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      reader.fail("model.vocab", fmt::format("the id of token '{}' must be a non-negative 32-bit integer", token));
    vocab_.emplace(token, static_cast<int32_t>(id.get<int64_t>()));
  }

  const std::string unk = reader.string_or(model, "model", "unk_token", "");
  if (!unk.empty()) {
    auto id = token_id(unk);
    if (!id) reader.fail("model.unk_token", fmt::format("'{}' is not in model.vocab", unk));
    unk_id_ = *id;
  }
  index_characters();
  auto merges = model.find("merges");
  if (merges == model.end() || !merges->is_array()) reader.fail("model", "missing 'merges' (a list)");
  read_merges(*merges, reader);
}

BpeModel::BpeModel(TokenIdMap vocab, const std::vector<BpeMerge>& merges, bool ignore_merges)
    : vocab_(std::move(vocab)), ignore_merges_(ignore_merges) {
  index_characters();
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const BpeMerge& merge = merges[rank];
    merges_[pair_key(merge.left, merge.right)] = Merge{static_cast<int32_t>(rank), merge.merged};
  }
}

void BpeModel::index_characters() {
  bmp_character_ids_.assign(0x10000, -1);
  for (const auto& [token, id] : vocab_) {
    if (token.empty() || utf8::unit_length(token, 0) != token.size()) continue;
    const int32_t code_point = utf8::code_point_at(token, 0);
    if (code_point >= 0 && code_point < 0x10000) bmp_character_ids_[code_point] = id;
  }
  byte_token_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    if (auto id = token_id(fmt::format("<0x{:02X}>", b))) byte_token_ids_[b] = *id;
  }
}

void BpeModel::read_merges(const nlohmann::json& merges, const TokenizerJsonReader& reader) {
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& merge = merges[rank];
    const std::string where = fmt::format("model.merges[{}]", rank);
    std::string left, right;
    if (merge.is_string()) {
      const auto& text = merge.get_ref<const std::string&>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
        reader.fail(where, fmt::format("'{}' must be two tokens separated by one space", text));
      left = text.substr(0, space), right = text.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>(), right = merge[1].get<std::string>();
    } else {
      reader.fail(where, "expected \"left right\" or [\"left\", \"right\"]");
    }
    const auto left_id = token_id(left), right_id = token_id(right), merged_id = token_id(left + right);
    if (!left_id || !right_id)
      reader.fail(where, fmt::format("merge references token '{}' that is not in model.vocab", left_id ? right : left));
    if (!merged_id)
      reader.fail(where, fmt::format("merged token '{}' is not in model.vocab", left + right));
    merges_[pair_key(*left_id, *right_id)] = Merge{static_cast<int32_t>(rank), *merged_id};
  }
}

std::optional<int32_t> BpeModel::token_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

std::optional<int32_t> BpeModel::character_id(std::string_view character) const {
  const int32_t code_point = utf8::code_point_at(character, 0);
  if (code_point >= 0 && code_point < 0x10000) {
    const int32_t id = bmp_character_ids_[code_point];
    return id >= 0 ? std::optional<int32_t>(id) : std::nullopt;
  }
  return token_id(character);
}

const BpeModel::Merge* BpeModel::find_merge(int32_t left, int32_t right) const {
  auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

// One symbol per character; characters outside the vocab become their byte tokens
// (byte_fallback) or unk. As in Hugging Face, a pending unk is emitted only when the next
// in-vocab character (or the end of the word) is reached, and fuse_unk folds a run of
// unknown characters into one unk.
std::vector<int32_t> BpeModel::initial_symbols(std::string_view word) const {
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  bool unk_pending = false;
  std::string suffixed;
  for (size_t pos = 0; pos < word.size();) {
    const size_t length = utf8::unit_length(word, pos);
    std::string_view character = word.substr(pos, length);
    pos += length;
    const bool with_suffix = pos == word.size() && !end_of_word_suffix_.empty();  // NOTE [End-of-word suffix]
    if (with_suffix) {
      suffixed.assign(character).append(end_of_word_suffix_);
      character = suffixed;
    }
    if (auto id = with_suffix ? token_id(character) : character_id(character)) {
      if (unk_pending) symbols.push_back(*unk_id_), unk_pending = false;
      symbols.push_back(*id);
      continue;
    }
    if (byte_fallback_) {
      bool all_bytes_known = true;
      for (char c : character) all_bytes_known &= byte_token_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all_bytes_known) {
        for (char c : character) symbols.push_back(byte_token_ids_[static_cast<uint8_t>(c)]);
        continue;
      }
    }
    if (!unk_id_) continue;
    if (unk_pending && !fuse_unk_) symbols.push_back(*unk_id_);
    unk_pending = true;
  }
  if (unk_pending) symbols.push_back(*unk_id_);
  return symbols;
}

void BpeModel::merge(std::vector<int32_t>& symbols) const {
  const int32_t n = static_cast<int32_t>(symbols.size());
  if (n < 2) return;
  std::vector<int32_t> prev(n), next(n);
  std::vector<bool> removed(n, false);
  for (int32_t i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;

  struct Candidate {
    int32_t rank, position, merged_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : position > o.position; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto push_pair = [&](int32_t position) {
    if (position < 0 || next[position] < 0) return;
    if (const Merge* m = find_merge(symbols[position], symbols[next[position]]))
      queue.push({m->rank, position, m->merged_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (removed[top.position] || next[top.position] < 0) continue;
    const int32_t right = next[top.position];
    const Merge* current = find_merge(symbols[top.position], symbols[right]);
    if (!current || current->merged_id != top.merged_id) continue;
    symbols[top.position] = top.merged_id;
    removed[right] = true;
    next[top.position] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.position;
    push_pair(prev[top.position]);
    push_pair(top.position);
  }
  int32_t kept = 0;
  for (int32_t i = 0; i < n; ++i)
    if (!removed[i]) symbols[kept++] = symbols[i];
  symbols.resize(kept);
}

// NOTE: a cache hit gives what ignore_merges would give too (the cache holds results
// computed the same way), so the cache is consulted first.
void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  const bool cacheable = TokenCache::cacheable(word);
  if (cacheable && cache_.find(word, out)) return;
  std::vector<int32_t> symbols;
  if (auto id = ignore_merges_ ? token_id(word) : std::nullopt) {
    symbols.push_back(*id);
  } else {
    symbols = initial_symbols(word);
    merge(symbols);
  }
  out.insert(out.end(), symbols.begin(), symbols.end());
  if (cacheable) cache_.insert(word, std::move(symbols));
}

}  // namespace forge
