// FP8 tensorwise training of a tiny model on the CPU reference (NOTE [FP8 projections] in
// model/fp8_projections.h): which descriptors carry FP8, and one training micro-batch in
// FP8 against the same micro-batch in fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/memory_estimate.h"
#include "model_testing.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::relative_l2;

using testing::llama31_8b;

TEST(ModelFp8, ProjectionsCarryFp8AndTheRestPassesThrough) {
  const ModelConfig config = testing::tiny();
  FlatParameters params(config), grads(config);
  for (bool head : {false, true}) {
    Fp8Projections fp8(config, {Fp8Format::E5M2, head}, Device::CPU, 16);
    fp8.set_base(params, grads);
    for (int i = 0; i < config.num_layers; ++i) {
      const BlockWeights& block = fp8.layer(i);
      const BlockWeights& grad_block = fp8.layer_grads(i);
      const BlockWeights& base = params.layer(i);
      ASSERT_EQ(block.params.size(), base.params.size());
      for (size_t e = 0; e < block.params.size(); ++e) {
        const bool projection = base.params[e].weight.ndim() == 2;
        EXPECT_EQ(block.params[e].fp8 != nullptr, projection) << "layer " << i << " entry " << e;
        EXPECT_EQ(grad_block.params[e].fp8 != nullptr, projection) << "layer " << i << " entry " << e;
        EXPECT_EQ(block.params[e].weight.raw(), base.params[e].weight.raw());
        if (projection) EXPECT_EQ(block.params[e].fp8->grad_format, Fp8Format::E5M2);
      }
    }
    EXPECT_EQ(fp8.output().fp8 != nullptr, head);
    EXPECT_EQ(fp8.output_grad().fp8 != nullptr, head);
    EXPECT_EQ(fp8.output().weight.raw(), params.output().weight.raw());
    EXPECT_EQ(fp8.embedding().raw(), params.embedding().raw());
    EXPECT_EQ(fp8.final_norm_grad().raw(), grads.final_norm_grad().raw());
  }
  // Bytes of each CUDA code buffer: the largest of tokens x in, tokens x out, out x in
  // over the projections (gate_up [80, 24] with 16 tokens: 80 x 24 = 1920), the head's
  // [37, 24] only when it runs in FP8 (no larger here).
  EXPECT_EQ(fp8_workspace_codes(config, {Fp8Format::E5M2, false}, 16), 80 * 24);
  EXPECT_EQ(fp8_workspace_codes(config, {Fp8Format::E5M2, true}, 100), 100 * 80);
}

// The memory estimate counts the CUDA scratch Fp8Projections allocates: two code buffers of
// fp8_workspace_codes bytes and six fp32 statistics (one function computes it for both).
TEST(ModelFp8, MemoryEstimateCountsTheCudaScratch) {
  struct Case {
    ModelConfig config;
    int64_t micro_batch, seq_len;
    bool head;
  };
  const std::vector<Case> cases = {{testing::tiny(), 1, 16, false}, {testing::tiny(), 2, 50, true},
                                   {llama31_8b(), 1, 8192, false}, {llama31_8b(), 2, 4096, true}};
  for (const Case& c : cases) {
    const Fp8Settings settings{Fp8Format::E5M2, c.head};
    const int64_t tokens = c.micro_batch * c.seq_len;
    const int64_t bytes = fp8_scratch_bytes(c.config, settings, tokens);
    const int64_t stats = 1 + c.config.num_layers * 6 + (c.head ? 1 : 0);  // shared, per layer parameter, head
    const int64_t blocks = c.config.num_layers * 4 + (c.head ? 1 : 0);     // NOTE [FP8 projection statistics]
    EXPECT_EQ(fp8_projection_count(c.config, settings), blocks);
    EXPECT_EQ(bytes, 3 * fp8_workspace_codes(c.config, settings, tokens) + stats * kFp8WorkspaceStats * 4 +
                         blocks * cpu::kFp8ProjectionStats * 4);
    Fp8Settings delayed = settings;
    delayed.recipe = Fp8Recipe::Delayed;  // + the amax histories: 3 per projection
    EXPECT_EQ(fp8_scratch_bytes(c.config, delayed, tokens), bytes + blocks * 3 * 1024 * 4);
    Fp8Settings cached = settings;
    cached.weight_cache = true;  // NOTE [FP8 weight cache]: W and W^T codes, a byte each
    EXPECT_EQ(fp8_scratch_bytes(c.config, cached, tokens), bytes);
    EXPECT_EQ(fp8_weight_cache_bytes(c.config, cached), 2 * fp8_gemm_params(c.config, settings));
    EXPECT_EQ(fp8_weight_cache_bytes(c.config, settings), 0);
    MemoryPlan plan;
    plan.micro_batch = c.micro_batch;
    plan.seq_len = c.seq_len;
    plan.cuda = true;
    const MemoryEstimate bf16 = estimate_memory(c.config, plan);
    plan.fp8 = settings;
    const MemoryEstimate fp8 = estimate_memory(c.config, plan);
    EXPECT_EQ(fp8.fp8_scratch, static_cast<double>(bytes));
    EXPECT_EQ(fp8.total(), bf16.total() + fp8.fp8_scratch);
    EXPECT_NE(describe(fp8).find(" + FP8 GEMM scratch "), std::string::npos);
    EXPECT_EQ(describe(bf16).find("FP8"), std::string::npos);
    plan.cuda = false;  // the CPU path allocates no scratch
    EXPECT_EQ(estimate_memory(c.config, plan).fp8_scratch, 0.0);
  }
  // Llama 3.1 8B, one sequence of 8192 tokens: gate_up's tokens x 2 x 14336 codes, twice
  // (the README's 0.44 GiB); with the head in FP8, tokens x vocab.
  EXPECT_EQ(fp8_scratch_bytes(llama31_8b(), {}, 8192), 3 * int64_t{8192} * 28672 + (1 + 32 * 6) * kFp8WorkspaceStats * 4 +
                                                           32 * 4 * cpu::kFp8ProjectionStats * 4);
  EXPECT_EQ(fp8_scratch_bytes(llama31_8b(), {Fp8Format::E5M2, true}, 8192),
            3 * int64_t{8192} * 128256 + (2 + 32 * 6) * kFp8WorkspaceStats * 4 + (32 * 4 + 1) * cpu::kFp8ProjectionStats * 4);
  MemoryPlan plan;
  plan.seq_len = 8192;
  plan.cuda = true;
  plan.fp8 = Fp8Settings{};
  EXPECT_NE(describe(estimate_memory(llama31_8b(), plan)).find("FP8 GEMM scratch 0.66 GiB"), std::string::npos);
}

// NOTE [FP8 under data parallelism]: under FSDP every rank holds the same FP8 scratch as one
// device and, with the weight cache, the codes of every FP8 weight in full (not sharded).
TEST(ModelFp8, MemoryEstimateUnderFsdpCountsTheScratchAndTheWholeCache) {
  MemoryPlan plan;
  plan.seq_len = 8192;
  plan.cuda = true;
  plan.fsdp = true;
  plan.shard_ranks = 8;
  for (const int64_t stage : {1, 3}) {
    plan.zero_stage = stage;
    plan.fp8.reset();
    const MemoryEstimate bf16 = estimate_memory(llama31_8b(), plan);
    Fp8Settings settings;
    settings.weight_cache = true;
    plan.fp8 = settings;
    const MemoryEstimate fp8 = estimate_memory(llama31_8b(), plan);
    EXPECT_EQ(fp8.fp8_scratch, static_cast<double>(fp8_scratch_bytes(llama31_8b(), settings, 8192)));
    EXPECT_EQ(fp8.fp8_weight_cache, static_cast<double>(fp8_weight_cache_bytes(llama31_8b(), settings)));
    EXPECT_EQ(fp8.total(), bf16.total() + fp8.fp8_scratch + fp8.fp8_weight_cache) << "ZeRO-" << stage;
    EXPECT_NE(describe(fp8).find("FP8 weight cache 13.00 GiB"), std::string::npos) << describe(fp8);
  }
}

// NOTE [FP8 under context and pipeline parallelism]: a context-parallel rank's scratch is
// for its 1/C of the micro-batch's tokens; a pipeline rank holds the whole model's
// statistics and histories (the scratch as one device's) and the weight cache of its
// stages' FP8 weights alone (the last stage's head with fp8_output_head).
TEST(ModelFp8, MemoryEstimateUnderContextAndPipelineParallelism) {
  const ModelConfig c = llama31_8b();
  Fp8Settings settings;
  settings.weight_cache = true;
  settings.recipe = Fp8Recipe::Delayed;
  MemoryPlan plan;
  plan.seq_len = 8192;
  plan.cuda = true;
  plan.fp8 = settings;
  plan.context_parallel = 4;
  plan.fsdp = true;
  plan.shard_ranks = 4;
  EXPECT_EQ(estimate_memory(c, plan).fp8_scratch, static_cast<double>(fp8_scratch_bytes(c, settings, 2048)));
  plan = MemoryPlan{};
  plan.seq_len = 8192;
  plan.cuda = true;
  plan.pipeline_parallel = 4;
  plan.micro_batches = 8;
  const MemoryEstimate bf16 = estimate_memory(c, plan);
  settings.output_head = true;
  plan.fp8 = settings;
  const MemoryEstimate fp8 = estimate_memory(c, plan);
  EXPECT_EQ(fp8.fp8_scratch, static_cast<double>(fp8_scratch_bytes(c, settings, 8192)));
  // The fullest rank: the first (the most micro-batches in flight) or the last (the head).
  const double stage = 8.0 * static_cast<double>(fp8_gemm_params(c, {}) / 32);  // 8 blocks' projections
  EXPECT_TRUE(fp8.fp8_weight_cache == 2 * stage || fp8.fp8_weight_cache == 2 * (stage + 128256.0 * 4096))
      << fp8.fp8_weight_cache;
  EXPECT_GT(fp8.total(), bf16.total() + fp8.fp8_scratch + 2 * stage - 1);
}

// forge info's share of the FLOPs in FP8: 6 x the parameters of the matrices trained in FP8.
TEST(ModelFp8, GemmParamsAreTheProjectionsAndTheHeadOnRequest) {
  const ModelConfig c = llama31_8b();
  const int64_t per_layer = int64_t{4096} * (4096 + 2 * 1024) + 4096 * 4096 + 2 * 14336 * 4096 + 4096 * 14336;
  EXPECT_EQ(fp8_gemm_params(c, {}), 32 * per_layer);
  EXPECT_EQ(fp8_gemm_params(c, {Fp8Format::E5M2, true}), 32 * per_layer + 128256 * int64_t{4096});
}

struct StepResult {
  double loss = 0.0;
  std::vector<double> errors;  // per parameter, relative_l2 against the fp32 step
};

// One micro-batch (batch 4 x 16 tokens) of the tiny model in FP8 tensorwise (head in
// fp32) against the same micro-batch in fp32 from the same weights.
StepResult fp8_step_against_fp32(Fp8Format grad_format, double* fp32_loss) {
  const ModelConfig config = testing::tiny();
  const int64_t batch = 4, seq = 16;
  FlatParameters params(config), grads(config), grads_fp8(config);
  params.initialize(11);
  const Tensor tokens = testing::random_tokens(batch, seq, config.vocab_size, 3);
  const Tensor targets = testing::random_tokens(batch, seq, config.vocab_size, 4);
  DecoderLM model(config, batch, seq);
  grads.discard();
  *fp32_loss = model.forward_backward(tokens, targets, params, grads, 1.0f / (batch * seq)).mean();
  Fp8Projections fp8(config, {grad_format, false}, Device::CPU, batch * seq);
  fp8.set_base(params, grads_fp8);
  grads_fp8.discard();
  StepResult r;
  r.loss = model.forward_backward(tokens, targets, fp8, fp8, 1.0f / (batch * seq)).mean();
  for (size_t k = 0; k < params.specs().size(); ++k)
    r.errors.push_back(relative_l2(grads_fp8.tensors()[k], grads.tensors()[k]));
  return r;
}

// Tolerances. E4M3 keeps 3 mantissa bits (a rounding error of up to 2^-4 of each element),
// E5M2 2 bits (2^-3). The tiny model's dot products are short (24 to 80 terms, 64 tokens
// for dW), so the errors cancel little, and they compound through 2 blocks and the
// backward. Measured (E5M2 gradients): loss within 0.003%; gradients' relative L2 error
// 1% (embedding, final norm, head) to 12% (the first block's mlp norm and gate_up); with
// E4M3 gradients at most 7%. The bounds, loss 1% and gradients 20%, leave room for the
// last bits of a different summation order and still catch a wrong GEMM (an operand
// transposed, a scale missing or applied twice, a gradient dropped: 50% to 100% or more).
// That the error is the gradient format's rounding shows in the E4M3 run being closer.
TEST(ModelFp8, TrainingMicroBatchTracksFp32) {
  double loss = 0.0;
  const StepResult e5m2 = fp8_step_against_fp32(Fp8Format::E5M2, &loss);
  const StepResult e4m3 = fp8_step_against_fp32(Fp8Format::E4M3, &loss);
  const std::vector<ParamSpec> specs = parameter_specs(testing::tiny());
  EXPECT_NEAR(e5m2.loss, loss, 0.01 * loss);
  EXPECT_NE(e5m2.loss, loss);  // FP8 did run
  EXPECT_EQ(e4m3.loss, e5m2.loss);  // the forward has no gradient
  double sum5 = 0.0, sum4 = 0.0;
  for (size_t k = 0; k < specs.size(); ++k) {
    EXPECT_LT(e5m2.errors[k], 0.2) << specs[k].name;
    EXPECT_LT(e4m3.errors[k], 0.2) << specs[k].name;
    EXPECT_GT(e5m2.errors[k], 0.0) << specs[k].name;
    sum5 += e5m2.errors[k];
    sum4 += e4m3.errors[k];
  }
  EXPECT_LT(sum4, sum5);
}

// Recomputation under activation checkpointing quantizes the same tensors again, to the
// same codes: every mode gives bitwise the same FP8 gradients, the FP8 head included.
TEST(ModelFp8, EveryCheckpointingModeGivesTheSameGradients) {
  const ModelConfig config = testing::tiny();
  FlatParameters params(config);
  params.initialize(1);
  const Tensor tokens = testing::random_tokens(2, 8, config.vocab_size, 3);
  const Tensor targets = testing::random_tokens(2, 8, config.vocab_size, 4);
  std::vector<Tensor> grads;
  for (ActivationCheckpoint mode : {ActivationCheckpoint::None, ActivationCheckpoint::Selective,
                                    ActivationCheckpoint::Full}) {
    FlatParameters g(config);
    Fp8Projections fp8(config, {Fp8Format::E5M2, true}, Device::CPU, 16);
    fp8.set_base(params, g);
    DecoderLM model(config, 2, 8, Device::CPU, DType::F32, mode);
    g.discard();
    model.forward_backward(tokens, targets, fp8, fp8, 1.0f / 16);
    grads.push_back(g.flat().clone());
  }
  EXPECT_TRUE(testing::bitwise_equal(grads[0], grads[1]));
  EXPECT_TRUE(testing::bitwise_equal(grads[0], grads[2]));
}

}  // namespace
}  // namespace forge
