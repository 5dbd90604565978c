// The MLPerf Training Llama 2 70B LoRA data as distributed: GovReport (SCROLLS gov_report)
// tokenized and packed, in DIR/train.npy and DIR/validation.npy (data.source govreport_npy,
// data.path DIR).
//
// NOTE [GovReport .npy layout]
// The MLCommons reference's preprocessing (mlcommons/training, llama2_70b_lora/scripts/
// utils.py create_datasets, last changed in commit 42aaab30, read at aa344c7f) formats as
//   "### Summarize the following text:\n {input}\n ### Summary:\n {output}</s>",
// drops examples over 8192 tokens and packs the rest back to back into blocks of exactly
// 8192 tokens (group_texts; the remainder is dropped): labels = input_ids for training,
// and for validation -100 on every prompt token and on each example's last token. The
// files MLCommons distributes are that output as parquet (input_ids, attention_mask,
// labels; llama2_70b_lora/scripts/train.py reads train-00000-of-00001.parquet), and the
// submissions' scripts/convert_dataset.py (mlcommons/training_results_v4.0,
// NVIDIA/benchmarks/llama2_70b_lora/implementations/nemo, commit 62f111b7) turns each
// split into train.npy / validation.npy with numpy.save of a list of dicts, one per block:
//   input_ids     the block's 8192 token ids (the parquet column: an integer ndarray)
//   loss_mask     [int(label != -100) for label in labels]: a list of 0/1
//   seq_start_id  [0]: the block is one causal sequence (no attention reset at packed
//                 example boundaries, as the reference's HF model sees it)
// So a file is an object array (data/npy_records.h). A record becomes one forge sample of
// training.seq_len + 1 = 8192 tokens (8191 predictions, as the reference's shifted loss):
// the target of token t is token t + 1 when loss_mask[t + 1] is 1, else ignored (forge's
// response flag: NOTE [Example batches] in dataset.h); seq_start_id entries start new
// examples (positions restart, attention does not cross them). Training samples are
// visited in a seeded random order every epoch, validation in file order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace forge {

// DIR/train.npy or DIR/validation.npy for a split (Test is an error).
std::string govreport_npy_file(const std::string& dir, Split split);

class GovReportDataset : public TokenDataset {
 public:
  // Reads and validates every record of `path`: the keys, equal lengths of input_ids and
  // loss_mask, seq_len + 1 tokens each, token ids below vocab_size, a 0/1 loss_mask and
  // increasing seq_start_id from 0. Errors name the file, the record and the key.
  GovReportDataset(const std::string& path, int64_t seq_len, int64_t vocab_size, bool shuffle);
  int64_t num_samples() const override { return num_samples_; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t epoch, int64_t index, int32_t* out) const override;
  bool shuffle_samples() const override { return shuffle_; }
  bool has_examples() const override { return true; }
  void sample_examples(int64_t epoch, int64_t index, int32_t* tokens, int32_t* example,
                       uint8_t* response) const override;

 private:
  size_t sample_offset(int64_t epoch, int64_t index) const;  // of sample `index` in the arrays below

  int64_t seq_len_, num_samples_ = 0;
  bool shuffle_;
  std::vector<int32_t> tokens_, example_;  // num_samples x (seq_len + 1)
  std::vector<uint8_t> loss_mask_;         // num_samples x (seq_len + 1)
};

}  // namespace forge
