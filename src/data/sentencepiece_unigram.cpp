#include "data/sentencepiece_unigram.h"

#include <algorithm>
#include <cfloat>

namespace forge {
namespace {

constexpr float kUnknownPenalty = 10.0f;

}  // namespace

SentencePieceUnigram::SentencePieceUnigram(const SentencePieceVocab& vocab) : vocab_(vocab) {
  float lowest_score = FLT_MAX, highest_score = FLT_MIN;
  for (int32_t id = 0; id < vocab_.size(); ++id) {
    if (vocab_.type(id) != SentencePieceType::Normal) continue;
    lowest_score = std::min(lowest_score, vocab_.score(id));
    highest_score = std::max(highest_score, vocab_.score(id));
  }
  unknown_score_ = lowest_score - kUnknownPenalty;
  offer_scores_.assign(vocab_.size(), 0.0f);
  std::vector<std::pair<std::string, int32_t>> keys;
  for (int32_t id = 0; id < vocab_.size(); ++id) {
    const SentencePieceType type = vocab_.type(id);
    if (type == SentencePieceType::Normal) {
      offer_scores_[id] = vocab_.score(id);
    } else if (type == SentencePieceType::UserDefined) {
      offer_scores_[id] = static_cast<float>(vocab_.piece(id).size()) * highest_score - 0.1f;
    } else {
      continue;
    }
    keys.emplace_back(vocab_.piece(id), id);
  }
  pieces_ = ByteTrie(std::move(keys));
}

void SentencePieceUnigram::encode(std::string_view text, std::vector<int32_t>& ids) const {
  struct BestPath {
    float score = 0.0f;    // of the best path ending here
    int32_t start = -1;    // where its last piece starts; -1 while nothing reached here
    int32_t id = -1;       // its last piece
  };
  thread_local std::vector<BestPath> best;
  best.assign(text.size() + 1, BestPath{});
  for (size_t start = 0; start < text.size();) {
    const float score_here = best[start].score;
    const size_t character = sentencepiece_character_length(text, start);
    bool character_is_a_piece = false;
    pieces_.for_each_prefix(text.substr(start), [&](size_t length, int32_t id) {
      BestPath& end = best[start + length];
      const float offer = offer_scores_[id] + score_here;
      if (end.start < 0 || offer > end.score) end = {offer, static_cast<int32_t>(start), id};
      character_is_a_piece |= length == character;
    });
    if (!character_is_a_piece) {
      BestPath& end = best[start + character];
      const float offer = unknown_score_ + score_here;
      if (end.start < 0 || offer > end.score) end = {offer, static_cast<int32_t>(start), vocab_.unk_id()};
    }
    start += character;
  }
  thread_local std::vector<int32_t> path_ends;
  path_ends.clear();
  for (size_t end = text.size(); end > 0; end = best[end].start) path_ends.push_back(static_cast<int32_t>(end));
  for (auto it = path_ends.rbegin(); it != path_ends.rend(); ++it) {
    const BestPath& piece = best[*it];
    vocab_.append_piece(text.substr(piece.start, *it - piece.start), piece.id, ids);
  }
}

}  // namespace forge
