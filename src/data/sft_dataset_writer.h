// The output of `forge prep --format sft`: two Megatron indexed datasets side by side,
//   <prefix>.bin / <prefix>.idx            token ids (uint16 or int32 by vocabulary size)
//   <prefix>.mask.bin / <prefix>.mask.idx  dtype uint8: 1 where the token is response
// each with one sequence and one document per example, so their sequence lengths and
// document indices are identical.
//
// NOTE [SFT dataset pair]
// Both datasets are written under temporary names (NOTE [Atomic dataset output]) and only
// put in place once both are complete, in this order: every existing file among
// <prefix>.idx, .mask.idx, .bin, .mask.bin is first renamed aside, in that order (to
// <file>.tmp-<host>-<pid>.previous), then the new mask's .bin and .idx are renamed into
// place, then the tokens' .bin, and the tokens' .idx last; then the set-aside files are
// deleted. <prefix>.idx is what makes a dataset visible, and it appears last, so:
//   - a crash at any point leaves either the old pair, or no <prefix>.idx (the run must
//     be repeated; the old files are beside, under .previous names), or the new pair:
//     never tokens with a stale mask, never tokens whose mask is missing;
//   - an error the process survives (a rename refused) removes what was put in place
//     and renames the set-aside files back: the old pair, whole.
// A text prep (`--format text`) over a prefix that has a mask moves the stale
// <prefix>.mask.* aside the same way and deletes them once its .bin/.idx are in place, so
// no mask is left beside a dataset it does not describe.
#pragma once

#include <string>

#include "data/indexed_dataset.h"
#include "data/sft_tokenize.h"

namespace forge {

// "<prefix>.mask": the prefix of the mask dataset beside the token dataset at `prefix`.
std::string mask_prefix(const std::string& prefix);

class SftDatasetWriter {
 public:
  SftDatasetWriter(const std::string& prefix, IndexedDType token_dtype);

  void add_example(const SftTokens& example);
  // Completes both datasets and puts them in place (NOTE [SFT dataset pair]).
  void finalize();
  uint64_t output_bytes() const;  // the four files' sizes, after finalize()

 private:
  std::string prefix_;
  IndexedDatasetWriter tokens_, mask_;
};

// `writer` (the dataset at `prefix`) finalized and put in place, with any mask dataset at
// mask_prefix(prefix) removed as NOTE [SFT dataset pair] says.
void finalize_replacing_mask(IndexedDatasetWriter& writer, const std::string& prefix);

}  // namespace forge
