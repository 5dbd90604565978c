// The check for packed instruction data: several examples packed into one sample,
// with attention confined to each example and positions restarting (NOTE [Packed
// examples]), give the loss and gradients of the same examples run one per sample with
// plain causal attention, under every activation-checkpointing mode and with a sliding
// window. The examples come through the real path: files -> SftDataset -> DataLoader.
#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.h"
#include "data/dataset.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "model_testing.h"
#include "sft_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using testing::SftExample;
using testing::tiny;

std::vector<SftExample> random_examples(int count, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<SftExample> examples;
  for (int e = 0; e < count; ++e) {
    SftExample x;
    const int64_t length = 3 + static_cast<int64_t>(rng.below(9));
    const int64_t prompt = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(length - 1)));
    for (int64_t i = 0; i < length; ++i) {
      x.tokens.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab))));
      x.mask.push_back(i >= prompt ? 1 : 0);
    }
    examples.push_back(x);
  }
  return examples;
}

std::unique_ptr<TokenDataset> sft(const std::string& prefix, const std::string& packing, int64_t seq_len,
                                  int64_t vocab) {
  DataConfig config;
  config.source = "sft";
  config.path = prefix;
  config.split = "1";
  config.packing = packing;
  return make_dataset(config, Split::Train, seq_len, vocab, 17);
}

Batch whole_epoch(const TokenDataset& data) { return DataLoader(data, data.num_samples(), 1).next(); }

TEST(ModelPacking, PackedExamplesGiveTheLossAndGradientsOfEachExampleAlone) {
  TempDir dir;
  const int64_t seq_len = 16;
  for (int64_t window : {0, 4}) {
    ModelConfig c = tiny();
    c.sliding_window = window;
    testing::write_sft(dir.file("d"), random_examples(9, c.vocab_size, 5 + window));
    auto packed_data = sft(dir.file("d"), "packed", seq_len, c.vocab_size);
    auto padded_data = sft(dir.file("d"), "padded", seq_len, c.vocab_size);
    ASSERT_EQ(padded_data->num_samples(), 9);
    ASSERT_LT(packed_data->num_samples(), 9);
    const Batch packed = whole_epoch(*packed_data), padded = whole_epoch(*padded_data);
    const SequenceLayout layout{packed.positions, packed.segments};

    FlatParameters params(c), reference(c);
    params.initialize(3);
    reference.zero();
    // One example per row, plain causal attention from position 0: the examples alone.
    DecoderLM alone(c, padded.tokens.dim(0), seq_len);
    const LossSum want = alone.forward_backward(padded.tokens, padded.targets, params, reference, 1.0f);
    ASSERT_GT(want.tokens, 0);
    for (ActivationCheckpoint mode :
         {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
      DecoderLM model(c, packed.tokens.dim(0), seq_len, Device::CPU, DType::F32, mode);
      FlatParameters grads(c);
      grads.zero();
      const LossSum got = model.forward_backward(packed.tokens, packed.targets, params, grads, 1.0f, &layout);
      const std::string what = fmt::format("window {} checkpointing {}", window, activation_checkpoint_name(mode));
      EXPECT_EQ(got.tokens, want.tokens) << what;
      EXPECT_NEAR(got.sum, want.sum, 1e-5 * want.sum) << what;
      const LossSum eval = model.forward_loss(packed.tokens, packed.targets, params, &layout);
      EXPECT_EQ(eval.sum, got.sum) << what;
      const float* a = reference.flat().data<float>();
      const float* b = grads.flat().data<float>();
      double max_abs = 0, max_diff = 0;
      for (int64_t i = 0; i < reference.flat().numel(); ++i) {
        max_abs = std::max(max_abs, std::abs(double(a[i])));
        max_diff = std::max(max_diff, std::abs(double(a[i]) - b[i]));
      }
      EXPECT_LT(max_diff, 1e-5 * max_abs) << what;
    }
    // Without the layout the packed rows are one long sequence each: a different loss (at
    // initialization the tiny model is near uniform, so the difference is small).
    DecoderLM model(c, packed.tokens.dim(0), seq_len);
    const LossSum unconfined = model.forward_loss(packed.tokens, packed.targets, params);
    EXPECT_GT(std::abs(unconfined.sum - want.sum), 1e-4 * want.sum);  // ten times the tolerance above
  }
}

TEST(ModelPacking, RejectsLayoutsThatDoNotFitTheBatch) {
  ModelConfig c = tiny();
  FlatParameters params(c);
  params.initialize(1);
  DecoderLM model(c, 1, 8);
  Tensor tokens = Tensor::zeros({1, 8}, DType::I32), targets = Tensor::zeros({1, 8}, DType::I32);
  SequenceLayout layout{Tensor::zeros({1, 8}, DType::I32), Tensor::zeros({1, 8}, DType::I32)};
  layout.positions.data<int32_t>()[3] = 8;  // past the rotary tables
  EXPECT_THROW(model.forward_loss(tokens, targets, params, &layout), Error);
  SequenceLayout short_layout{Tensor::zeros({1, 7}, DType::I32), Tensor::zeros({1, 7}, DType::I32)};
  EXPECT_THROW(model.forward_loss(tokens, targets, params, &short_layout), Error);
}

}  // namespace
}  // namespace forge
