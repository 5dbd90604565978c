// Unigram as SentencePiece encodes it (model_type UNIGRAM, sentencepiece's default: T5,
// ALBERT, XLNet, mBART, XLM-R and others ship one), token for token equal to
// sentencepiece's unigram::Model::Encode, which runs EncodeOptimized.
//
// What sentencepiece does. Each piece has a score, a log probability; a segmentation's
// score is the sum of its pieces' scores, and encoding picks the best segmentation of
// the whole normalized text (no splitting into words) by Viterbi: walking the start
// positions left to right (character by character), every text piece that begins there
// (found by walking a trie of the pieces) offers "best path to here + its score" to the
// position where it ends, and a position keeps the first best offer it gets. UNUSED
// pieces are skipped. A USER_DEFINED piece scores length_in_bytes × (highest NORMAL
// score) − 0.1, which in practice makes it win wherever it matches. Where no piece covers a single
// character, an unknown piece of that character scores (lowest NORMAL score) − 10.
// The best path is read back from the end.
//
// NOTE [Unigram score arithmetic]
// The result hangs on exact floating-point ties and roundings, so forge computes what
// sentencepiece 0.2.3 computes: every score and sum is a float (an offer is
// float(piece score) + float(best path here), compared with the float stored at the end
// position; a user-defined piece scores float(length) × highest − 0.1f). The highest
// NORMAL score starts from FLT_MIN (the smallest positive float), as in sentencepiece,
// so it is never negative. (The 0.2.1 source read for this adds in double; 0.2.3's
// results show float sums: a test text's "1,000,000" segments differently otherwise.)
// Because every path score sums from the text's first character, splitting the text and
// caching parts (as forge's BPE does) could change a rounding and with it a tie, so the
// unigram model always runs over the whole text.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "data/byte_trie.h"
#include "data/sentencepiece_model.h"
#include "data/sentencepiece_vocab.h"

namespace forge {

class SentencePieceUnigram final : public SentencePieceModel {
 public:
  // `vocab` must outlive the model.
  explicit SentencePieceUnigram(const SentencePieceVocab& vocab);

  void encode(std::string_view normalized, std::vector<int32_t>& ids) const override;

 private:
  const SentencePieceVocab& vocab_;
  ByteTrie pieces_;                    // NORMAL and USER_DEFINED pieces
  std::vector<float> offer_scores_;   // per id: what a piece adds to a path (NOTE [Unigram score arithmetic])
  float unknown_score_ = 0.0f;
};

}  // namespace forge
