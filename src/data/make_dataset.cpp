// make_dataset: from DataConfig to a TokenDataset, validating the config values with
// errors that name the data.* key. Seeds are derived per purpose from the run seed: one
// stream for the synthetic transition table (shared by all splits, so validation
// measures the same source), and one per split for sample contents and shuffles, so that
// train, validation and test never share samples; a blend derives one more per component.
//
// NOTE [Separate validation data]
// data.validation_path (Megatron-LM's --valid-data-path) names an indexed dataset that the
// Validation and Test splits read instead of a data.split share of the training data: all
// of its sequences, packed as the training data is but in file order and visited in order
// (PackedOrder::InFileOrder), so every evaluation reads the first N windows of the file's
// concatenated token stream, whatever the seed or epoch. This is MLPerf's llama31_8b
// evaluation: "the first 1024 sequences in the validation dataset ... We do not shuffle the
// validation dataset" (mlcommons/training small_llm_pretraining/nemo/README.md), read from
// c4-validation-91205-samples.en_text_document. The Train split then reads all of data.path
// (or of each data.blend dataset), shuffled as usual; data.split is not used.
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/rng.h"
#include "data/blended_dataset.h"
#include "data/dataset.h"
#include "data/generated_datasets.h"
#include "data/govreport_dataset.h"
#include "data/packed_dataset.h"
#include "data/sft_dataset.h"

namespace forge {

namespace {

constexpr uint64_t kSyntheticTableStream = 0x5EED7AB1E;
constexpr uint64_t kSplitStreamBase = 0xDA7A0000;
constexpr int64_t kUnboundedSamples = int64_t{1} << 40;
constexpr uint64_t kBlendComponentStreamBase = 0xB1E7D000;

void validate(const DataConfig& config, int64_t seq_len, int64_t vocab_size) {
  if (seq_len < 1) FORGE_FAIL("training.seq_len is {}: expected a positive number of tokens", seq_len);
  if (vocab_size < 1 || vocab_size > std::numeric_limits<int32_t>::max())
    FORGE_FAIL("model vocab_size is {}: expected 1 to {}", vocab_size, std::numeric_limits<int32_t>::max());
  if (config.num_samples < 0)
    FORGE_FAIL("data.num_samples is {}: expected 0 (unbounded) or a positive count", config.num_samples);
  if (config.source != "synthetic" && config.source != "mock" && config.source != "indexed" && config.source != "sft" &&
      config.source != "govreport_npy")
    FORGE_FAIL("data.source is '{}': expected synthetic, mock, indexed, sft or govreport_npy", config.source);
  if (config.packing != "packed" && config.packing != "padded")
    FORGE_FAIL("data.packing is '{}': expected packed or padded", config.packing);
  if (config.overlong != "truncate" && config.overlong != "drop")
    FORGE_FAIL("data.overlong is '{}': expected truncate or drop", config.overlong);
  if (config.source == "sft" && (config.path.empty() || !config.blend.empty()))
    FORGE_FAIL("data.source sft reads one dataset: data.path must name its prefix (<path>.bin, <path>.idx, "
               "<path>.mask.bin, <path>.mask.idx) and data.blend be empty");
  if (config.source == "govreport_npy" && (config.path.empty() || !config.blend.empty()))
    FORGE_FAIL("data.source govreport_npy reads one directory: data.path must name the folder of train.npy and "
               "validation.npy and data.blend be empty");
  if (config.source == "indexed" && config.path.empty() && config.blend.empty())
    FORGE_FAIL("data.path and data.blend are empty: the indexed source needs the prefix of <path>.bin and "
               "<path>.idx, or a blend \"W1 PREFIX1 W2 PREFIX2 ...\"");
  if (config.source == "indexed" && !config.path.empty() && !config.blend.empty())
    FORGE_FAIL("data.path ('{}') and data.blend ('{}') are both set: give one of them", config.path, config.blend);
  if (!config.validation_path.empty() && config.source != "indexed")
    FORGE_FAIL("data.validation_path ('{}') is for data.source indexed, but data.source is '{}'",
               config.validation_path, config.source);
}

int64_t samples_per_epoch(const DataConfig& config) {
  return config.num_samples > 0 ? config.num_samples : kUnboundedSamples;
}

uint64_t split_seed(uint64_t seed, Split split) {
  return derive_seed(seed, kSplitStreamBase + static_cast<uint64_t>(split));
}

std::shared_ptr<const MarkovSource> synthetic_source(const DataConfig& config, int64_t vocab_size, uint64_t seed) {
  return std::make_shared<const MarkovSource>(vocab_size, config.synthetic_order, config.synthetic_concentration,
                                              derive_seed(seed, kSyntheticTableStream));
}

// The training data's share for `split`: all of it when validation comes from its own file.
std::unique_ptr<TokenDataset> make_packed_dataset(const std::string& prefix, const DataConfig& config, Split split,
                                                  int64_t seq_len, int64_t vocab_size, uint64_t seed) {
  auto data = std::make_shared<const IndexedDataset>(prefix);
  SequenceRange range = config.validation_path.empty()
                            ? split_sequence_range(config.split, split, data->num_sequences())
                            : SequenceRange{0, data->num_sequences()};
  return std::make_unique<PackedDataset>(std::move(data), range, seq_len, vocab_size, seed);
}

// NOTE [Separate validation data]: the whole file, in file order.
std::unique_ptr<TokenDataset> make_validation_file_dataset(const DataConfig& config, int64_t seq_len,
                                                           int64_t vocab_size) {
  try {
    auto data = std::make_shared<const IndexedDataset>(config.validation_path);
    SequenceRange all{0, data->num_sequences()};
    return std::make_unique<PackedDataset>(std::move(data), all, seq_len, vocab_size, 0, PackedOrder::InFileOrder);
  } catch (const Error& e) {
    FORGE_FAIL("data.validation_path ('{}'): {}", config.validation_path, e.what());
  }
}

// Each component gets its own seed, so that two components built from the same files
// still differ in order.
std::unique_ptr<TokenDataset> make_blended_dataset(const DataConfig& config, Split split, int64_t seq_len,
                                                   int64_t vocab_size, uint64_t seed) {
  std::vector<BlendComponent> blend = parse_blend(config.blend);
  std::vector<std::unique_ptr<TokenDataset>> components;
  std::vector<double> weights;
  for (size_t i = 0; i < blend.size(); ++i) {
    try {
      components.push_back(make_packed_dataset(blend[i].prefix, config, split, seq_len, vocab_size,
                                               derive_seed(seed, kBlendComponentStreamBase + i)));
    } catch (const Error& e) {
      FORGE_FAIL("data.blend dataset {} of {} ('{}'): {}", i + 1, blend.size(), blend[i].prefix, e.what());
    }
    weights.push_back(blend[i].weight);
  }
  return std::make_unique<BlendedDataset>(std::move(components), std::move(weights), seed);
}

}  // namespace

std::string_view split_name(Split split) {
  switch (split) {
    case Split::Train: return "train";
    case Split::Validation: return "validation";
    case Split::Test: return "test";
  }
  return "?";
}

std::unique_ptr<TokenDataset> make_dataset(const DataConfig& config, Split split, int64_t seq_len,
                                           int64_t vocab_size, uint64_t seed) {
  validate(config, seq_len, vocab_size);
  if (config.source == "mock")
    return std::make_unique<MockDataset>(seq_len, vocab_size, samples_per_epoch(config), split_seed(seed, split));
  if (config.source == "synthetic")
    return std::make_unique<SyntheticDataset>(synthetic_source(config, vocab_size, seed), seq_len,
                                              samples_per_epoch(config), split_seed(seed, split));
  if (config.source == "sft")
    return std::make_unique<SftDataset>(config.path, config.split, split, seq_len, vocab_size, split_seed(seed, split),
                                        SftOptions{config.packing == "packed", config.overlong == "drop"});
  if (config.source == "govreport_npy")
    return std::make_unique<GovReportDataset>(govreport_npy_file(config.path, split), seq_len, vocab_size,
                                              split == Split::Train);
  if (!config.validation_path.empty() && split != Split::Train)
    return make_validation_file_dataset(config, seq_len, vocab_size);
  if (!config.blend.empty()) return make_blended_dataset(config, split, seq_len, vocab_size, split_seed(seed, split));
  return make_packed_dataset(config.path, config, split, seq_len, vocab_size, split_seed(seed, split));
}

double data_entropy_floor(const DataConfig& config, int64_t seq_len, int64_t vocab_size, uint64_t seed) {
  validate(config, seq_len, vocab_size);
  if (config.source == "mock") return std::log(static_cast<double>(vocab_size));
  if (config.source == "synthetic") return synthetic_source(config, vocab_size, seed)->sample_entropy_floor(seq_len);
  return -1.0;
}

}  // namespace forge
