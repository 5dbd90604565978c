// Model-level checks that need no reference implementation: parameter accounting against
// the published sizes, determinism, and that gradient accumulation over micro-batches
// equals one large micro-batch. The numerical comparison with PyTorch lives in
// tests/python/test_model_vs_torch.py.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "model/parameters.h"
#include "model/decoder_lm.h"

namespace forge {
namespace {

using testing::llama31_8b;
using testing::random_tokens;
using testing::tiny;

TEST(ModelAccounting, Llama31_8bParameterCount) {
  ModelConfig c = llama31_8b();
  EXPECT_EQ(c.total_params(), 8030261248);  // Hugging Face meta-llama/Llama-3.1-8B
  int64_t from_specs = 0;
  for (const auto& s : parameter_specs(c)) from_specs += shape_numel(s.shape);
  EXPECT_EQ(from_specs, c.total_params());
}

TEST(ModelAccounting, FlopsPerTokenFollowsPerfMd) {
  ModelConfig c = llama31_8b();
  double expected = 6.0 * (8030261248.0 - 128256.0 * 4096.0) + 6.0 * 32 * 4096 * 8192;
  EXPECT_DOUBLE_EQ(c.flops_per_token(8192), expected);
}

TEST(ModelAccounting, TiedEmbeddingsShareOneTensor) {
  ModelConfig c = tiny(true);
  FlatParameters p(c);
  EXPECT_EQ(p.output().weight.raw(), p.embedding().raw());
  EXPECT_EQ(c.total_params(), p.flat().numel());
}

TEST(ModelValidation, RejectsInconsistentHeads) {
  ModelConfig c = tiny();
  c.num_kv_heads = 3;
  EXPECT_THROW(c.validate(), Error);
  try {
    c.validate();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.num_kv_heads"), std::string::npos) << e.what();
  }
}

TEST(ModelTraining, ForwardBackwardIsBitwiseDeterministic) {
  ModelConfig c = tiny();
  FlatParameters params(c), g1(c), g2(c);
  params.initialize(7);
  DecoderLM model(c, 2, 16);
  Tensor tokens = random_tokens(2, 16, c.vocab_size, 1), targets = random_tokens(2, 16, c.vocab_size, 2);
  g1.zero();
  g2.zero();
  LossSum a = model.forward_backward(tokens, targets, params, g1, 1.0f / 32);
  LossSum b = model.forward_backward(tokens, targets, params, g2, 1.0f / 32);
  EXPECT_EQ(a.sum, b.sum);
  EXPECT_TRUE(testing::bitwise_equal(g1.flat(), g2.flat()));
}

TEST(ModelTraining, ActivationCheckpointingGivesTheSameGradientsBitForBit) {
  // Recomputation runs the same deterministic kernels on the same inputs, so every mode
  // (NOTE [Activation checkpointing]) gives the uncheckpointed loss and gradients exactly.
  ModelConfig c = tiny();
  c.num_layers = 3;
  FlatParameters params(c), reference(c);
  params.initialize(11);
  Tensor tokens = random_tokens(2, 16, c.vocab_size, 3), targets = random_tokens(2, 16, c.vocab_size, 4);
  DecoderLM plain(c, 2, 16);
  reference.zero();
  LossSum expected = plain.forward_backward(tokens, targets, params, reference, 1.0f / 32);
  for (ActivationCheckpoint mode : {ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
    DecoderLM model(c, 2, 16, Device::CPU, DType::F32, mode);
    FlatParameters grads(c);
    grads.zero();
    LossSum got = model.forward_backward(tokens, targets, params, grads, 1.0f / 32);
    EXPECT_EQ(got.sum, expected.sum) << activation_checkpoint_name(mode);
    EXPECT_TRUE(testing::bitwise_equal(grads.flat(), reference.flat()))
        << activation_checkpoint_name(mode);
  }
}

TEST(ModelMemory, CheckpointingShrinksTheArenaAsPlanned) {
  ModelConfig c = llama31_8b();
  const int64_t n = 8192, h = c.hidden_size, f = c.ffn_hidden_size;
  const int64_t none = activation_bytes(c, 1, n, DType::BF16, ActivationCheckpoint::None);
  const int64_t selective = activation_bytes(c, 1, n, DType::BF16, ActivationCheckpoint::Selective);
  const int64_t full = activation_bytes(c, 1, n, DType::BF16, ActivationCheckpoint::Full);
  // Selective drops two normed inputs and the SwiGLU output from all but one shared copy.
  EXPECT_EQ(none - selective, (c.num_layers - 1) * n * (2 * h + f) * 2);
  EXPECT_LT(full, selective);
  // Full keeps one [n, h] input per layer, one layer's worth of everything and the 2 GiB
  // logits chunk: under 7 GiB here.
  EXPECT_LT(full, int64_t{7} << 30);
  EXPECT_GT(none, int64_t{32} << 30);
  // The decoder allocates exactly that arena.
  ModelConfig small = tiny();
  DecoderLM model(small, 2, 16, Device::CPU, DType::F32, ActivationCheckpoint::Full);
  EXPECT_EQ(model.arena_bytes(), activation_bytes(small, 2, 16, DType::F32, ActivationCheckpoint::Full));
}

TEST(ModelTraining, AccumulatingMicroBatchesEqualsOneBatch) {
  for (bool tied : {false, true}) {
    ModelConfig c = tiny(tied);
    FlatParameters params(c), whole(c), accumulated(c);
    params.initialize(3);
    Tensor tokens = random_tokens(2, 12, c.vocab_size, 5), targets = random_tokens(2, 12, c.vocab_size, 6);
    DecoderLM big(c, 2, 12), small(c, 1, 12);
    whole.zero();
    accumulated.zero();
    LossSum lw = big.forward_backward(tokens, targets, params, whole, 1.0f / 24);
    LossSum l0 = small.forward_backward(tokens.narrow(0, 1), targets.narrow(0, 1), params, accumulated, 1.0f / 24);
    LossSum l1 = small.forward_backward(tokens.narrow(1, 2), targets.narrow(1, 2), params, accumulated, 1.0f / 24);
    EXPECT_NEAR(lw.sum, l0.sum + l1.sum, 1e-4 * lw.sum);
    const float* a = whole.flat().data<float>();
    const float* b = accumulated.flat().data<float>();
    double max_abs = 0, max_diff = 0;
    for (int64_t i = 0; i < whole.flat().numel(); ++i) {
      max_abs = std::max(max_abs, std::abs(double(a[i])));
      max_diff = std::max(max_diff, std::abs(double(a[i]) - b[i]));
    }
    EXPECT_LT(max_diff, 1e-5 * max_abs) << "tied=" << tied;
  }
}

// NOTE [Fresh gradient buffers]: after discard() the model writes each unit's gradients
// over whatever the buffers hold (here NaN), and later micro-batches add to them: the
// same bits as zeroing first.
TEST(ModelTraining, DiscardedGradientsAreWrittenOverNotAddedTo) {
  for (bool tied : {false, true}) {
    ModelConfig c = tiny(tied);
    FlatParameters params(c), zeroed(c), discarded(c);
    params.initialize(3);
    Tensor tokens = random_tokens(2, 12, c.vocab_size, 5), targets = random_tokens(2, 12, c.vocab_size, 6);
    DecoderLM model(c, 1, 12);
    for (int step = 0; step < 2; ++step) {  // the second step finds the first one's sums
      zeroed.zero();
      if (step == 0) testing::fill_nan(discarded.flat());
      discarded.discard();
      for (int64_t m = 0; m < 2; ++m) {
        model.forward_backward(tokens.narrow(m, m + 1), targets.narrow(m, m + 1), params, zeroed, 1.0f / 24);
        model.forward_backward(tokens.narrow(m, m + 1), targets.narrow(m, m + 1), params, discarded, 1.0f / 24);
      }
      EXPECT_TRUE(testing::bitwise_equal(zeroed.flat(), discarded.flat())) << "tied=" << tied << " step " << step;
    }
  }
}

TEST(ModelTraining, MaskedTargetsContributeNothing) {
  ModelConfig c = tiny();
  FlatParameters params(c);
  params.initialize(11);
  DecoderLM model(c, 1, 8);
  Tensor tokens = random_tokens(1, 8, c.vocab_size, 3), targets = random_tokens(1, 8, c.vocab_size, 4);
  LossSum full = model.forward_loss(tokens, targets, params);
  targets.data<int32_t>()[5] = -100;
  LossSum masked = model.forward_loss(tokens, targets, params);
  EXPECT_EQ(full.tokens, 8);
  EXPECT_EQ(masked.tokens, 7);
  EXPECT_LT(masked.sum, full.sum);
}

}  // namespace
}  // namespace forge
