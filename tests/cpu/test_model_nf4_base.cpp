// QLoRA's NF4 base (model/nf4_base.h): which parameters are quantized and how (one NF4
// tensor per Hugging Face weight), and the decoder reading its projections from NF4 codes,
// which must give bitwise the loss and gradients of the same decoder on the dequantized
// weights, with and without activation checkpointing and a tied head.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "expect_error.h"
#include "model/decoder_lm.h"
#include "model/nf4_base.h"
#include "model_testing.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::tiny;

TEST(ModelNf4Base, QuantizesTheSevenProjectionsPerHuggingFaceTensor) {
  const ModelConfig c = tiny();
  FlatParameters params(c);
  params.initialize(3);
  const Nf4Base base = quantize_base_nf4(params);
  const std::vector<ParamSpec>& specs = params.specs();
  size_t quantized_tensors = 0;
  for (size_t k = 0; k < specs.size(); ++k) {
    EXPECT_EQ(base.quantized(k), specs[k].layer >= 0 && specs[k].shape.size() == 2) << specs[k].name;
    if (!base.quantized(k)) continue;
    const Nf4Weight& w = base.weights[k];
    ASSERT_EQ(w.parts.size(), specs[k].hf_tensors.size()) << specs[k].name;
    EXPECT_EQ(w.shape(), specs[k].shape);
    int64_t row = 0;
    for (size_t p = 0; p < w.parts.size(); ++p) {
      const int64_t rows = specs[k].hf_tensors[p].rows;
      const Nf4Tensor alone = nf4_quantize(params.tensors()[k].narrow(row, row + rows));
      EXPECT_TRUE(bitwise_equal(w.parts[p].codes, alone.codes)) << specs[k].hf_tensors[p].name;
      EXPECT_TRUE(bitwise_equal(w.parts[p].absmax_codes, alone.absmax_codes)) << specs[k].hf_tensors[p].name;
      row += rows;
      ++quantized_tensors;
    }
  }
  EXPECT_EQ(quantized_tensors, 7u * static_cast<size_t>(c.num_layers));  // q k v o gate up down
  EXPECT_EQ(nf4_base_bytes(c), static_cast<double>(base.nbytes()));
  EXPECT_EQ(nf4_scratch_bytes(c, DType::BF16), 2.0 * 2 * c.ffn_hidden_size * c.hidden_size);  // gate_up

  FlatParameters on_cuda_dtype(c, Device::CPU, DType::BF16);
  expect_error([&] { quantize_base_nf4(on_cuda_dtype); }, {"fp32 on the CPU", "bf16"});
}

// The parameters with every base projection replaced by its dequantized NF4 values.
void dequantize_projections(FlatParameters& params, const Nf4Base& base) {
  for (size_t k = 0; k < params.specs().size(); ++k)
    if (base.quantized(k)) nf4_dequantize(params.tensors()[k], base.weights[k]);
}

TEST(ModelNf4Base, DecoderOnNf4CodesEqualsDecoderOnTheDequantizedWeights) {
  for (bool tied : {false, true})
    for (ActivationCheckpoint checkpoint : {ActivationCheckpoint::None, ActivationCheckpoint::Full}) {
      const ModelConfig c = tiny(tied);
      FlatParameters params(c), dequantized(c), g_nf4(c), g_plain(c);
      params.initialize(11);
      const Nf4Base base = quantize_base_nf4(params);
      dequantized.assign_from(params);
      dequantize_projections(dequantized, base);
      // The NF4 source takes everything else from `params`, whose projections still hold
      // the unquantized values: were they read, the results would differ.
      Nf4BaseSource source(params, params.specs(), base, Device::CPU, DType::F32);

      DecoderLM model(c, 2, 16, Device::CPU, DType::F32, checkpoint);
      const Tensor tokens = testing::random_tokens(2, 16, c.vocab_size, 1);
      const Tensor targets = testing::random_tokens(2, 16, c.vocab_size, 2);
      EXPECT_EQ(model.forward_loss(tokens, targets, source).sum, model.forward_loss(tokens, targets, dequantized).sum);
      g_nf4.zero();
      g_plain.zero();
      const LossSum a = model.forward_backward(tokens, targets, source, g_nf4, 1.0f / 32);
      const LossSum b = model.forward_backward(tokens, targets, dequantized, g_plain, 1.0f / 32);
      EXPECT_EQ(a.sum, b.sum) << "tied " << tied;
      EXPECT_TRUE(bitwise_equal(g_nf4.flat(), g_plain.flat())) << "tied " << tied;
    }
}

TEST(ModelNf4Base, SourceRejectsMissingOrMisplacedCodes) {
  const ModelConfig c = tiny();
  FlatParameters params(c);
  params.initialize(5);
  Nf4Base base = quantize_base_nf4(params);
  Nf4Base missing = base;
  size_t qkv = 0;
  while (!missing.quantized(qkv)) ++qkv;
  missing.weights[qkv].parts.clear();
  expect_error([&] { Nf4BaseSource(params, params.specs(), missing, Device::CPU, DType::F32); },
               {params.specs()[qkv].name, "no NF4 codes"});
  Nf4Base short_list = base;
  short_list.weights.pop_back();
  expect_error([&] { Nf4BaseSource(params, params.specs(), short_list, Device::CPU, DType::F32); },
               {"NF4 entries", "parameters"});
}

TEST(ModelNf4Base, Llama8bBaseIsAboutHalfAByteAWeight) {
  const ModelConfig c = testing::llama31_8b();
  const double projection_weights = 32.0 * (4096.0 * (4096 + 2 * 1024) + 4096.0 * 4096 + 3 * 4096.0 * 14336);
  // 0.5 byte of codes, 1/64 byte of absmax codes, 4/16384 byte of scales, 4 bytes of offset per tensor.
  EXPECT_NEAR(nf4_base_bytes(c), projection_weights * (0.5 + 1.0 / 64 + 4.0 / 16384) + 7 * 32 * 4, 1.0);
}

}  // namespace
}  // namespace forge
