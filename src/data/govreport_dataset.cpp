#include "data/govreport_dataset.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "data/npy_records.h"

namespace forge {

std::string govreport_npy_file(const std::string& dir, Split split) {
  if (split == Split::Test)
    FORGE_FAIL("data.source govreport_npy has a train and a validation split (train.npy, validation.npy in "
               "data.path '{}'), no test split",
               dir);
  return dir + (split == Split::Train ? "/train.npy" : "/validation.npy");
}

GovReportDataset::GovReportDataset(const std::string& path, int64_t seq_len, int64_t vocab_size, bool shuffle)
    : seq_len_(seq_len), shuffle_(shuffle) {
  const size_t width = static_cast<size_t>(seq_len + 1);
  num_samples_ = read_npy_records(path, [&](int64_t r, const NpyRecord& record) {
    for (const auto& [key, values] : record)
      if (key != "input_ids" && key != "loss_mask" && key != "seq_start_id")
        FORGE_FAIL("{}: record {}: unknown key '{}': expected input_ids, loss_mask and seq_start_id "
                   "(NOTE [GovReport .npy layout])",
                   path, r, key);
    for (const char* key : {"input_ids", "loss_mask"})
      if (!record.contains(key)) FORGE_FAIL("{}: record {}: the key '{}' is missing", path, r, key);
    const std::vector<int64_t>& ids = record.at("input_ids");
    const std::vector<int64_t>& mask = record.at("loss_mask");
    if (ids.size() != width)
      FORGE_FAIL("{}: record {}: input_ids holds {} tokens: expected training.seq_len + 1 = {} (the reference packs "
                 "8192-token blocks: training.seq_len 8191)",
                 path, r, ids.size(), width);
    if (mask.size() != ids.size())
      FORGE_FAIL("{}: record {}: loss_mask holds {} values, input_ids {}: expected equal lengths", path, r,
                 mask.size(), ids.size());
    const std::vector<int64_t> starts = record.contains("seq_start_id") ? record.at("seq_start_id")
                                                                        : std::vector<int64_t>{0};
    if (starts.empty() || starts[0] != 0)
      FORGE_FAIL("{}: record {}: seq_start_id must begin with 0 (the start of the block)", path, r);
    for (size_t k = 1; k < starts.size(); ++k)
      if (starts[k] <= starts[k - 1] || starts[k] >= static_cast<int64_t>(width))
        FORGE_FAIL("{}: record {}: seq_start_id[{}] is {}: expected increasing starts below {}", path, r, k,
                   starts[k], width);
    int32_t example = 0;
    size_t next_start = 1;
    for (size_t t = 0; t < width; ++t) {
      if (ids[t] < 0 || ids[t] >= vocab_size)
        FORGE_FAIL("{}: record {}: input_ids[{}] is {}: expected a token id below the model's vocab_size {}", path, r,
                   t, ids[t], vocab_size);
      if (mask[t] != 0 && mask[t] != 1)
        FORGE_FAIL("{}: record {}: loss_mask[{}] is {}: expected 0 or 1", path, r, t, mask[t]);
      if (next_start < starts.size() && static_cast<int64_t>(t) == starts[next_start]) {
        ++example;
        ++next_start;
      }
      tokens_.push_back(static_cast<int32_t>(ids[t]));
      loss_mask_.push_back(static_cast<uint8_t>(mask[t]));
      example_.push_back(example);
    }
  });
  if (num_samples_ == 0) FORGE_FAIL("{}: holds no records: expected at least one 8192-token block", path);
}

size_t GovReportDataset::sample_offset(int64_t epoch, int64_t index) const {
  FORGE_CHECK(index >= 0 && index < num_samples_ && epoch >= 0, "sample {} of {} in epoch {}", index, num_samples_,
              epoch);
  return static_cast<size_t>(index) * static_cast<size_t>(seq_len_ + 1);
}

void GovReportDataset::sample_examples(int64_t epoch, int64_t index, int32_t* tokens, int32_t* example,
                                       uint8_t* response) const {
  const size_t width = static_cast<size_t>(seq_len_ + 1), at = sample_offset(epoch, index);
  std::memcpy(tokens, tokens_.data() + at, width * sizeof(int32_t));
  std::memcpy(example, example_.data() + at, width * sizeof(int32_t));
  std::memcpy(response, loss_mask_.data() + at, width);
}

void GovReportDataset::sample(int64_t epoch, int64_t index, int32_t* out) const {
  const size_t width = static_cast<size_t>(seq_len_ + 1);
  std::memcpy(out, tokens_.data() + sample_offset(epoch, index), width * sizeof(int32_t));
}

}  // namespace forge
