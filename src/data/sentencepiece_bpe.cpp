#include "data/sentencepiece_bpe.h"

#include <algorithm>

#include "data/utf8.h"

namespace forge {
namespace {

constexpr int32_t kRemoved = -2;  // a symbol merged into its left neighbour

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Where each character of `text` starts, and the end.
std::vector<size_t> character_starts(std::string_view text) {
  std::vector<size_t> starts;
  for (size_t pos = 0; pos < text.size(); pos += sentencepiece_character_length(text, pos)) starts.push_back(pos);
  starts.push_back(text.size());
  return starts;
}

}  // namespace

struct SentencePieceBpe::Symbols {
  std::vector<int32_t> symbol;   // kRemoved once merged away
  std::vector<uint32_t> begin;   // byte offset of the symbol's text
  std::vector<int32_t> previous, next;  // neighbours among the symbols left, -1 at the ends

  void clear() { symbol.clear(), begin.clear(), previous.clear(), next.clear(); }
  void add(int32_t s, size_t offset) {
    const auto index = static_cast<int32_t>(symbol.size());
    symbol.push_back(s), begin.push_back(static_cast<uint32_t>(offset));
    previous.push_back(index - 1), next.push_back(-1);
    if (index > 0) next[index - 1] = index;
  }
};

SentencePieceBpe::SentencePieceBpe(const SentencePieceVocab& vocab, const ByteTrie& user_defined_symbols,
                                   std::string_view whitespace)
    : vocab_(vocab),
      user_defined_symbols_(user_defined_symbols),
      whitespace_code_point_(utf8::code_point_at(whitespace, 0)) {
  output_ids_.resize(vocab_.size());
  std::vector<int32_t> code_points;
  for (int32_t id = 0; id < vocab_.size(); ++id) {
    output_ids_[id] = vocab_.piece_to_id(vocab_.piece(id));
    has_unused_pieces_ |= vocab_.type(id) == SentencePieceType::Unused;
    if (!is_text_piece(vocab_.type(id))) continue;
    const std::string& piece = vocab_.piece(id);
    for (size_t pos = 0; pos < piece.size(); pos += sentencepiece_character_length(piece, pos))
      code_points.push_back(utf8::code_point_at(piece, pos));
  }
  add_character_symbols(code_points);
  add_merges();
}

int32_t SentencePieceBpe::symbol_of(int32_t code_point) const {
  if (code_point < 0) return kInert;
  if (code_point < 0x10000) return bmp_symbols_[code_point];
  auto it = astral_symbols_.find(code_point);
  return it == astral_symbols_.end() ? kInert : it->second;
}

std::string_view SentencePieceBpe::symbol_text(int32_t symbol) const {
  return symbol < vocab_.size() ? std::string_view(vocab_.piece(symbol))
                                : std::string_view(synthetic_symbol_texts_[symbol - vocab_.size()]);
}

// A character that is a text piece is that piece's symbol; any other character some text
// piece contains gets a synthetic symbol; the rest stay inert.
void SentencePieceBpe::add_character_symbols(const std::vector<int32_t>& code_points) {
  bmp_symbols_.assign(0x10000, kInert);
  auto set_symbol = [&](int32_t code_point, int32_t symbol) {
    if (code_point < 0x10000) {
      bmp_symbols_[code_point] = symbol;
    } else {
      astral_symbols_[code_point] = symbol;
    }
  };
  for (int32_t id = 0; id < vocab_.size(); ++id) {
    const std::string& piece = vocab_.piece(id);
    if (!is_text_piece(vocab_.type(id)) || sentencepiece_character_length(piece, 0) != piece.size()) continue;
    if (const int32_t code_point = utf8::code_point_at(piece, 0); code_point >= 0) set_symbol(code_point, id);
  }
  for (int32_t code_point : code_points) {
    if (code_point < 0 || symbol_of(code_point) != kInert) continue;
    std::string text;
    utf8::append(text, static_cast<uint32_t>(code_point));
    set_symbol(code_point, vocab_.size() + static_cast<int32_t>(synthetic_symbol_texts_.size()));
    output_ids_.push_back(vocab_.piece_to_id(text));
    synthetic_symbol_texts_.push_back(std::move(text));
  }
}

// Every cut of a text piece into two symbols is a merge; every pair of adjacent
// characters in a text piece is a join that cutting words must respect
// (NOTE [SentencePiece BPE words]).
void SentencePieceBpe::add_merges() {
  bmp_whitespace_joins_.assign(0x10000, 0);
  auto add_join = [&](int32_t code_point, uint8_t flag) {
    if (code_point < 0) return;
    if (code_point < 0x10000) {
      bmp_whitespace_joins_[code_point] |= flag;
    } else {
      astral_whitespace_joins_[code_point] |= flag;
    }
  };
  auto symbol_of_text = [&](std::string_view text) {
    if (sentencepiece_character_length(text, 0) == text.size()) return symbol_of(utf8::code_point_at(text, 0));
    const auto id = vocab_.find_text_piece(text);
    return id ? *id : kInert;
  };
  for (int32_t id = 0; id < vocab_.size(); ++id) {
    if (!is_text_piece(vocab_.type(id))) continue;
    const std::string_view piece = vocab_.piece(id);
    const std::vector<size_t> starts = character_starts(piece);
    for (size_t i = 1; i + 1 < starts.size(); ++i) {
      const int32_t left = symbol_of_text(piece.substr(0, starts[i]));
      const int32_t right = symbol_of_text(piece.substr(starts[i]));
      if (left != kInert && right != kInert) merges_[pair_key(left, right)] = Merge{id, vocab_.score(id)};
      const int32_t before = utf8::code_point_at(piece, starts[i - 1]), after = utf8::code_point_at(piece, starts[i]);
      if (after == whitespace_code_point_) add_join(before, kJoinedBeforeWhitespace);
      if (before == whitespace_code_point_) add_join(after, kJoinedAfterWhitespace);
    }
  }
}

const SentencePieceBpe::Merge* SentencePieceBpe::find_merge(int32_t left, int32_t right) const {
  auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

uint8_t SentencePieceBpe::whitespace_joins(int32_t code_point) const {
  if (code_point < 0x10000) return bmp_whitespace_joins_[code_point];
  auto it = astral_whitespace_joins_.find(code_point);
  return it == astral_whitespace_joins_.end() ? 0 : it->second;
}

// Where words may be cut (NOTE [SentencePiece BPE words]): next to a character no text
// piece contains, and next to the whitespace character unless a text piece joins the two.
bool SentencePieceBpe::cut_between(int32_t left_code_point, int32_t left_symbol, int32_t right_code_point,
                                   int32_t right_symbol) const {
  if (left_symbol == kInert || right_symbol == kInert) return true;
  if (right_code_point == whitespace_code_point_) return !(whitespace_joins(left_code_point) & kJoinedBeforeWhitespace);
  if (left_code_point == whitespace_code_point_) return !(whitespace_joins(right_code_point) & kJoinedAfterWhitespace);
  return false;
}

// The merge loop of sentencepiece's bpe::Model (see the file comment). With
// `unused_pairs`, records the last pair queued for each UNUSED piece, as sentencepiece
// does for resegmenting.
void SentencePieceBpe::merge(Symbols& symbols,
                             std::unordered_map<int32_t, std::pair<int32_t, int32_t>>* unused_pairs) const {
  struct Candidate {
    float score;
    int32_t left, left_symbol, right_symbol, piece;
  };
  // Highest score first, then leftmost.
  auto lower = [](const Candidate& a, const Candidate& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  thread_local std::vector<Candidate> queue;
  queue.clear();
  auto& symbol = symbols.symbol;
  auto& next = symbols.next;
  auto& previous = symbols.previous;
  auto push = [&](int32_t left) {
    if (left < 0 || next[left] < 0) return;
    const int32_t left_symbol = symbol[left], right_symbol = symbol[next[left]];
    if (left_symbol < 0 || right_symbol < 0) return;
    const Merge* merge = find_merge(left_symbol, right_symbol);
    if (!merge) return;
    queue.push_back({merge->score, left, left_symbol, right_symbol, merge->piece});
    std::push_heap(queue.begin(), queue.end(), lower);
    if (unused_pairs && vocab_.type(merge->piece) == SentencePieceType::Unused)
      (*unused_pairs)[merge->piece] = {left_symbol, right_symbol};
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbol.size()); ++i) push(i);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), lower);
    const Candidate top = queue.back();
    queue.pop_back();
    const int32_t right = next[top.left];
    if (symbol[top.left] != top.left_symbol || right < 0 || symbol[right] != top.right_symbol) continue;
    symbol[top.left] = top.piece;
    symbol[right] = kRemoved;
    next[top.left] = next[right];
    if (next[right] >= 0) previous[next[right]] = top.left;
    push(previous[top.left]);
    push(top.left);
  }
}

void SentencePieceBpe::append_symbol(int32_t symbol, std::string_view surface,
                                     const std::unordered_map<int32_t, std::pair<int32_t, int32_t>>* unused_pairs,
                                     std::vector<int32_t>& ids) const {
  const int32_t id = symbol >= 0 ? output_ids_[symbol] : vocab_.piece_to_id(surface);
  if (unused_pairs && vocab_.type(id) == SentencePieceType::Unused) {
    if (auto it = unused_pairs->find(id); it != unused_pairs->end()) {
      const auto [left, right] = it->second;
      append_symbol(left, symbol_text(left), unused_pairs, ids);
      append_symbol(right, symbol_text(right), unused_pairs, ids);
      return;
    }
  }
  vocab_.append_piece(surface, id, ids);
}

void SentencePieceBpe::encode_word(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  const size_t seam = ids.size();
  const bool cacheable = TokenCache::cacheable(word);
  if (cacheable && cache_.find(word, ids)) {
    vocab_.join_unknown_run(ids, seam);
    return;
  }
  thread_local Symbols symbols;
  symbols.clear();
  for (size_t pos = 0; pos < word.size(); pos += sentencepiece_character_length(word, pos))
    symbols.add(symbol_of(utf8::code_point_at(word, pos)), pos);
  merge(symbols, nullptr);
  std::vector<int32_t> word_ids;
  for (int32_t i = 0; i >= 0; i = symbols.next[i]) {
    const size_t end = symbols.next[i] >= 0 ? symbols.begin[symbols.next[i]] : word.size();
    append_symbol(symbols.symbol[i], word.substr(symbols.begin[i], end - symbols.begin[i]), nullptr, word_ids);
  }
  ids.insert(ids.end(), word_ids.begin(), word_ids.end());
  vocab_.join_unknown_run(ids, seam);
  if (cacheable) cache_.insert(word, std::move(word_ids));
}

void SentencePieceBpe::encode_whole(std::string_view text, std::vector<int32_t>& ids) const {
  Symbols symbols;
  for (size_t pos = 0; pos < text.size();) {
    if (user_defined_symbols_.may_start_with(static_cast<uint8_t>(text[pos]))) {
      if (const size_t length = user_defined_symbols_.longest_prefix(text.substr(pos))) {
        symbols.add(kInert, pos);
        pos += length;
        continue;
      }
    }
    symbols.add(symbol_of(utf8::code_point_at(text, pos)), pos);
    pos += sentencepiece_character_length(text, pos);
  }
  if (symbols.symbol.empty()) return;
  std::unordered_map<int32_t, std::pair<int32_t, int32_t>> unused_pairs;
  merge(symbols, &unused_pairs);
  for (int32_t i = 0; i >= 0; i = symbols.next[i]) {
    const size_t end = symbols.next[i] >= 0 ? symbols.begin[symbols.next[i]] : text.size();
    append_symbol(symbols.symbol[i], text.substr(symbols.begin[i], end - symbols.begin[i]), &unused_pairs, ids);
  }
}

void SentencePieceBpe::encode(std::string_view text, std::vector<int32_t>& ids) const {
  if (has_unused_pieces_) return encode_whole(text, ids);
  size_t word_begin = 0, pos = 0;
  int32_t previous_code_point = -1, previous_symbol = kInert;
  while (pos < text.size()) {
    if (user_defined_symbols_.may_start_with(static_cast<uint8_t>(text[pos]))) {
      if (const size_t length = user_defined_symbols_.longest_prefix(text.substr(pos))) {
        encode_word(text.substr(word_begin, pos - word_begin), ids);
        const std::string_view symbol = text.substr(pos, length);
        vocab_.append_piece(symbol, vocab_.piece_to_id(symbol), ids);
        pos += length;
        word_begin = pos;
        continue;
      }
    }
    const int32_t code_point = utf8::code_point_at(text, pos);
    const int32_t symbol = symbol_of(code_point);
    if (pos > word_begin && cut_between(previous_code_point, previous_symbol, code_point, symbol)) {
      encode_word(text.substr(word_begin, pos - word_begin), ids);
      word_begin = pos;
    }
    previous_code_point = code_point;
    previous_symbol = symbol;
    pos += sentencepiece_character_length(text, pos);
  }
  encode_word(text.substr(word_begin), ids);
}

}  // namespace forge
