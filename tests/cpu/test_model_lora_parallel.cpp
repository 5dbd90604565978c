// LoRA under context and tensor parallelism (NOTE [LoRA under context and tensor
// parallelism] in model/lora.h): T x C ranks (threads of this process over the CPU process
// group), each with its own adapters over its own frozen base (its tensor-parallel shards),
// each handed the same micro-batch and computing on its two chunks of every sequence, report
// the loss one process gives with the whole micro-batch, and their adapter gradients (the
// split matrices' shards spread into the whole) summed over the ranks are that process's.
// Trained B (not PEFT's zeros) so that A has a gradient too; every checkpointing mode, 2 and
// 4 context-parallel ranks, 2 and 4 tensor-parallel ones, 2 x 2 of both, some targets and
// the fused names. Dropout under tensor parallelism: the column-parallel adapters' masks
// are one process's; the row-parallel ones', each rank's own, give gradients that are the
// derivative of the loss the ranks compute (a central difference along the gradient).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "cli/config.h"
#include "distributed/context_parallel_group.h"
#include "distributed/tensor_parallel_group.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/parameters.h"
#include "lora_testing.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;
using testing::trained_adapters;

LoraConfig lora_of(const std::string& targets) {
  LoraConfig c;
  c.rank = 4;
  c.alpha = 8.0;
  c.target_modules = targets;
  return c;
}

struct Case {
  std::string model;
  int ranks;  // C
  ActivationCheckpoint mode = ActivationCheckpoint::None;
  std::string targets = "all-linear";
  int tensor_parallel = 1;  // T: T x C ranks
  double dropout = 0.0;     // the same masks as one process's only where no rank draws its own
};

void expect_ranks_match_one(const Case& c) {
  SCOPED_TRACE(fmt::format("LoRA on {} ({}) over {} context-parallel x {} tensor-parallel ranks, checkpointing {}",
                           c.model, c.targets, c.ranks, c.tensor_parallel, static_cast<int>(c.mode)));
  const ModelConfig m = load_experiment("", {{"model.name", c.model}}).model;
  LoraConfig lora = lora_of(c.targets);
  lora.dropout = c.dropout;
  const int64_t micro = 2, seq = 16;
  const int cp = c.ranks, tp = c.tensor_parallel, world = cp * tp;
  const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 21);
  Tensor targets = testing::random_tokens(micro, seq, m.vocab_size, 22);
  targets.data<int32_t>()[5] = -100;  // masked positions, in two ranks' chunks
  targets.data<int32_t>()[seq + 14] = -100;
  const float scale = 1.0f / static_cast<float>(micro * seq);

  FlatParameters base(m);
  base.initialize(5);
  auto one = trained_adapters(m, lora, micro * seq, base);
  DecoderLM whole(m, micro, seq, Device::CPU, DType::F32, c.mode);
  one->discard();
  one->set_dropout_step(77, 3);
  const LossSum reference = whole.forward_backward(tokens, targets, *one, *one, scale);

  // World rank w is tensor-parallel rank w % T of context-parallel rank w / T, its base its
  // shards, its adapters whole with the split matrices' shards.
  std::vector<std::unique_ptr<FlatParameters>> bases;
  std::vector<std::unique_ptr<LoraAdapters>> ranks;
  for (int w = 0; w < world; ++w) {
    const TensorParallelShard shard{w % tp, tp};
    bases.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, shard));
    bases.back()->initialize(5);
    ranks.push_back(trained_adapters(m, lora, micro * seq / cp, *bases.back(), shard));
  }
  std::vector<LossSum> losses(static_cast<size_t>(world));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(world, [&](int w) {
    auto group = create_process_group(testing::env_of(w, world, port), options);
    auto tp_group = group->split(w / tp, w % tp);  // the ranks of one context-parallel rank
    auto cp_group = group->split(w % tp, w / tp);  // the ranks of one tensor-parallel rank
    GroupTensorParallel tensor_parallel(*tp_group);
    GroupContextParallel context_parallel(*cp_group);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, c.mode, nullptr, tp > 1 ? &tensor_parallel : nullptr,
                    cp > 1 ? &context_parallel : nullptr);
    LoraAdapters& adapters = *ranks[static_cast<size_t>(w)];
    adapters.discard();
    adapters.set_dropout_step(77, 3);
    losses[static_cast<size_t>(w)] = model.forward_backward(tokens, targets, adapters, adapters, scale);
    adapters.spread_shard_gradients();
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  for (int w = 0; w < world; ++w) {  // every rank's loss is the micro-batch's
    EXPECT_EQ(losses[static_cast<size_t>(w)].tokens, reference.tokens);
    EXPECT_NEAR(losses[static_cast<size_t>(w)].sum, reference.sum, 1e-5 * std::abs(reference.sum)) << "rank " << w;
  }
  // Summed over every rank (as the trainer's all-reduces over the data-, context- and
  // tensor-parallel ranks do): one process's gradients.
  const std::vector<std::string> names = one->master_names();
  for (size_t i = 0; i < one->gradients().size(); ++i) {
    const Tensor& expected = one->gradients()[i];
    Tensor sum = Tensor::zeros(expected.shape());
    for (int w = 0; w < world; ++w) {
      const Tensor& g = ranks[static_cast<size_t>(w)]->gradients()[i];
      for (int64_t j = 0; j < g.numel(); ++j) sum.data<float>()[j] += g.data<float>()[j];
    }
    double norm = 0.0;
    for (int64_t j = 0; j < expected.numel(); ++j) norm += std::abs(static_cast<double>(expected.data<float>()[j]));
    EXPECT_GT(norm, 0.0) << names[i] << ": a gradient to compare";
    EXPECT_LT(relative_gap(sum, expected), 2e-5) << names[i] << "'s gradient summed over the ranks";
  }
}

TEST(ModelLoraContextParallel, TwoRanksMatchOneInEveryCheckpointingMode) {
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny", 2, mode});
}

TEST(ModelLoraContextParallel, FourRanksAndSomeTargets) {
  expect_ranks_match_one({"debug-tiny-mha", 4, ActivationCheckpoint::Selective});
  expect_ranks_match_one({"debug-tiny", 4, ActivationCheckpoint::None, "q_proj,v_proj,down_proj"});
}

TEST(ModelLoraTensorParallel, TwoRanksMatchOneInEveryCheckpointingMode) {
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny", 1, mode, "all-linear", 2});
}

TEST(ModelLoraTensorParallel, SomeTargetsFusedNamesAndContextParallelism) {
  expect_ranks_match_one({"debug-tiny-mha", 1, ActivationCheckpoint::None, "k_proj,o_proj,up_proj", 4});
  expect_ranks_match_one({"debug-tiny", 1, ActivationCheckpoint::Selective, "qkv_proj,gate_up_proj,down_proj", 2});
  expect_ranks_match_one({"debug-tiny", 2, ActivationCheckpoint::Full, "all-linear", 2});
}

// Column-parallel adapters (qkv's, gate/up's) draw one process's dropout masks on every
// tensor-parallel rank: the same step as one process's.
TEST(ModelLoraTensorParallel, ColumnParallelDropoutIsOneProcesss) {
  expect_ranks_match_one({"debug-tiny", 1, ActivationCheckpoint::Full, "q_proj,v_proj,gate_proj", 2, 0.25});
  expect_ranks_match_one({"debug-tiny", 1, ActivationCheckpoint::None, "qkv_proj,up_proj", 2, 0.25});
}

// With dropout each rank's row-parallel adapters draw their own masks, and the forward adds
// their share in one call beside the frozen GEMM's row pieces: the gradients summed over the
// ranks are still the derivative of the loss the ranks compute with those masks. Checked
// along the gradient itself: the central difference of the loss over +-eps of the unit
// direction is its norm.
void expect_dropout_gradient_is_the_losss_derivative(const std::string& model, int tp, ActivationCheckpoint mode,
                                                     const std::string& targets) {
  SCOPED_TRACE(fmt::format("LoRA on {} ({}) with dropout on {} tensor-parallel ranks, checkpointing {}", model, targets,
                           tp, static_cast<int>(mode)));
  const ModelConfig m = load_experiment("", {{"model.name", model}}).model;
  LoraConfig lora = lora_of(targets);
  lora.dropout = 0.3;
  const int64_t micro = 2, seq = 16;
  const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 31);
  const Tensor targets_ids = testing::random_tokens(micro, seq, m.vocab_size, 32);
  const float scale = 1.0f / static_cast<float>(micro * seq);
  const double eps = 1e-2;
  std::vector<std::unique_ptr<FlatParameters>> bases;
  std::vector<std::unique_ptr<LoraAdapters>> ranks;
  for (int w = 0; w < tp; ++w) {
    bases.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{w, tp}));
    bases.back()->initialize(5);
    ranks.push_back(trained_adapters(m, lora, micro * seq, *bases.back(), {w, tp}));
  }
  std::vector<double> slope(static_cast<size_t>(tp)), norm(static_cast<size_t>(tp)), dropped(static_cast<size_t>(tp));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(tp, [&](int w) {
    auto group = create_process_group(testing::env_of(w, tp, port), options);
    GroupTensorParallel tensor_parallel(*group);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, mode, nullptr, &tensor_parallel);
    LoraAdapters& adapters = *ranks[static_cast<size_t>(w)];
    adapters.discard();
    adapters.set_dropout_step(77, 3);
    const double loss = model.forward_backward(tokens, targets_ids, adapters, adapters, scale).sum * scale;
    adapters.spread_shard_gradients();
    group->all_reduce(adapters.gradient_flat(), ReduceOp::Sum);
    const Tensor g = adapters.gradient_flat().clone(), theta = adapters.master_flat().clone();
    double sum = 0.0;
    for (int64_t i = 0; i < g.numel(); ++i) sum += static_cast<double>(g.data<float>()[i]) * g.data<float>()[i];
    norm[static_cast<size_t>(w)] = std::sqrt(sum);
    auto loss_at = [&](double step) {
      for (int64_t i = 0; i < g.numel(); ++i)
        adapters.master_flat().data<float>()[i] = static_cast<float>(
            theta.data<float>()[i] + step * g.data<float>()[i] / norm[static_cast<size_t>(w)]);
      adapters.refresh_compute();
      return model.forward_loss(tokens, targets_ids, adapters).sum * scale;
    };
    slope[static_cast<size_t>(w)] = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
    adapters.set_training(false);
    dropped[static_cast<size_t>(w)] = loss - loss_at(0.0);  // the masks changed the loss
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  for (int w = 0; w < tp; ++w) {
    EXPECT_GT(norm[static_cast<size_t>(w)], 0.0);
    EXPECT_NEAR(slope[static_cast<size_t>(w)], norm[static_cast<size_t>(w)], 2e-2 * norm[static_cast<size_t>(w)])
        << "rank " << w;
    EXPECT_NE(dropped[static_cast<size_t>(w)], 0.0) << "rank " << w;
  }
}

TEST(ModelLoraTensorParallel, RowParallelDropoutGradientIsTheLosssDerivative) {
  expect_dropout_gradient_is_the_losss_derivative("debug-tiny", 2, ActivationCheckpoint::None, "o_proj,down_proj");
  expect_dropout_gradient_is_the_losss_derivative("debug-tiny", 2, ActivationCheckpoint::Selective, "all-linear");
  expect_dropout_gradient_is_the_losss_derivative("debug-tiny-mha", 4, ActivationCheckpoint::Full, "all-linear");
}

}  // namespace
}  // namespace forge
