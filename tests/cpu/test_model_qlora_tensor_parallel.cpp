// QLoRA under tensor parallelism (NOTE [NF4 base under tensor parallelism] in
// model/nf4_base.h): each rank's Nf4FrozenBase holds its shards, quantized on their own.
// Their 4-bit codes are bitwise the one-device base's codes of the same weights (every
// shard is whole NF4 blocks of the whole tensor), their double-quantized absmax values close
// to it (measured and printed); two ranks (threads of this process over the CPU process
// group) train exactly as one rank's LoRA over the base their dequantized shards make
// (loss and adapter gradients within fp32 reordering), and close to one device's QLoRA
// (measured and printed). The memory estimate counts a rank's codes; a degree whose shards
// would cut NF4 blocks is refused naming the projection.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "cli/config.h"
#include "distributed/tensor_parallel_group.h"
#include "expect_error.h"
#include "lora_testing.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/memory_estimate.h"
#include "model/nf4_base.h"
#include "model/parameters.h"
#include "model_testing.h"
#include "ops/nf4.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;
using testing::trained_adapters;

// debug-tiny widened so that two ranks' shards are whole NF4 blocks: o's 128 columns and
// down's 256 split into 64 and 128.
ModelConfig wide_tiny() {
  return load_experiment("", {{"model.name", "debug-tiny"}, {"model.hidden_size", "128"},
                              {"model.ffn_hidden_size", "256"}})
      .model;
}

LoraConfig qlora() {
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8.0;
  lora.target_modules = "all-linear";
  lora.quantize_base = "nf4";
  return lora;
}

// The 4-bit code of element j of an NF4 weight (its parts stacked along the rows).
int nibble(const Nf4Weight& w, int64_t j) {
  for (const Nf4Tensor& part : w.parts) {
    if (j < part.numel()) {
      const uint8_t byte = part.codes.data<uint8_t>()[j / 2];
      return j % 2 == 0 ? byte >> 4 : byte & 0x0f;
    }
    j -= part.numel();
  }
  ADD_FAILURE() << "element past the weight's end";
  return -1;
}

// Every block's absmax from the double-quantized statistics, per element (element j's block's).
std::vector<float> element_absmax(const Nf4Weight& w) {
  std::vector<float> out;
  for (const Nf4Tensor& part : w.parts) {
    const Tensor absmax = nf4_absmax(part);
    for (int64_t j = 0; j < part.numel(); ++j) out.push_back(absmax.data<float>()[j / 64]);
  }
  return out;
}

// The ranks' shards of `bases` (dequantized) at their places in the whole model.
FlatParameters assembled(const ModelConfig& m, const std::vector<std::unique_ptr<Nf4FrozenBase>>& bases) {
  FlatParameters whole(m);
  const int t = static_cast<int>(bases.size());
  for (int r = 0; r < t; ++r) {
    FlatParameters shards(m, Device::CPU, DType::F32, {r, t});
    bases[static_cast<size_t>(r)]->dequantize_into(shards);
    for (size_t k = 0; k < whole.specs().size(); ++k)
      for (const ShardRun& run : tensor_parallel_runs(whole.specs()[k], {r, t}))
        std::copy_n(shards.tensors()[k].data<float>() + run.local_begin, run.count,
                    whole.tensors()[k].data<float>() + run.full_begin);
  }
  return whole;
}

TEST(ModelQloraTensorParallel, ShardCodesAreTheWholeBasesCodes) {
  const ModelConfig m = wide_tiny();
  const int t = 2;
  FlatParameters host(m);
  host.initialize(5);
  const Nf4FrozenBase one(host, Device::CPU, DType::F32);
  double absmax_gap = 0.0;
  int64_t compared = 0;
  for (int r = 0; r < t; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    Nf4FrozenBase rank(m, Device::CPU, DType::F32, {}, {}, {r, t});
    rank.initialize(5);
    FlatParameters shards(m, Device::CPU, DType::F32, {r, t});
    for (size_t k = 0; k < one.specs().size(); ++k) {
      const ParamSpec& full = one.specs()[k];
      ASSERT_EQ(rank.specs()[k].shape, tensor_parallel_spec(full, {r, t}).shape) << full.name;
      if (!is_quantized_base_weight(full)) {
        Tensor mine = Tensor::empty(rank.specs()[k].shape);
        rank.dequantize(k, mine);
        for (const ShardRun& run : tensor_parallel_runs(full, {r, t}))
          for (int64_t i = 0; i < run.count; ++i)
            ASSERT_EQ(mine.data<float>()[run.local_begin + i], host.tensors()[k].data<float>()[run.full_begin + i])
                << full.name;
        continue;
      }
      const Nf4Weight& mine = rank.codes().weights[k];
      const Nf4Weight& whole = one.codes().weights[k];
      ASSERT_EQ(mine.parts.size(), whole.parts.size()) << full.name;
      const std::vector<float> mine_absmax = element_absmax(mine), whole_absmax = element_absmax(whole);
      for (const ShardRun& run : tensor_parallel_runs(full, {r, t}))
        for (int64_t i = 0; i < run.count; ++i) {
          const int64_t local = run.local_begin + i, global = run.full_begin + i;
          ASSERT_EQ(nibble(mine, local), nibble(whole, global)) << full.name << " element " << global;
          const float a = mine_absmax[static_cast<size_t>(local)], b = whole_absmax[static_cast<size_t>(global)];
          absmax_gap = std::max(absmax_gap, static_cast<double>(std::abs(a - b) / b));
          ++compared;
        }
    }
  }
  // The second level (8-bit codes of the absmax around the shard's own mean, scales over
  // the shard's own groups of 256 blocks) is the shard's.
  std::printf("QLoRA tensor parallelism over %d ranks: %lld codes bitwise the one-device base's, block absmax "
              "within %.3g (relative)\n",
              t, static_cast<long long>(compared), absmax_gap);
  EXPECT_LT(absmax_gap, 2e-2);

  MemoryPlan plan;
  plan.micro_batch = 2;
  plan.seq_len = 16;
  plan.lora = qlora();
  const double one_device = estimate_memory(m, plan).nf4_base;
  plan.tensor_parallel = t;
  const MemoryEstimate e = estimate_memory(m, plan);
  Nf4FrozenBase rank0(m, Device::CPU, DType::F32, {}, {}, {0, t});
  rank0.initialize(5);
  EXPECT_EQ(e.frozen_weights + e.nf4_base, static_cast<double>(rank0.nbytes()));
  EXPECT_LT(e.nf4_base, 0.6 * one_device);
}

TEST(ModelQloraTensorParallel, ShardsThatCutNf4BlocksAreRefused) {
  // debug-tiny: o's 64 columns split into 32 a rank.
  const ModelConfig narrow = load_experiment("", {{"model.name", "debug-tiny"}}).model;
  expect_error([&] { Nf4FrozenBase(narrow, Device::CPU, DType::F32, {}, {}, {0, 2}); },
               {"QLoRA under tensor parallelism over 2 ranks", "its 32 columns of layers.0", "block of 64",
                "model.num_heads x head dim 64 / 2 = 32"});
  // o's 128 columns split into 64, but down's 192 into 96.
  const ModelConfig ffn_192 =
      load_experiment("", {{"model.name", "debug-tiny"}, {"model.hidden_size", "128"}}).model;
  expect_error([&] { check_nf4_tensor_parallel(ffn_192, 2); },
               {"its 96 columns of layers.0", "model.ffn_hidden_size 192 / 2 = 96"});
  check_nf4_tensor_parallel(wide_tiny(), 2);
}

void expect_qlora_ranks_match(ActivationCheckpoint mode) {
  SCOPED_TRACE(fmt::format("checkpointing {}", static_cast<int>(mode)));
  const ModelConfig m = wide_tiny();
  const int t = 2;
  const LoraConfig lora = qlora();
  LoraConfig plain = lora;
  plain.quantize_base = "none";
  const int64_t micro = 2, seq = 16;
  const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 21);
  Tensor targets = testing::random_tokens(micro, seq, m.vocab_size, 22);
  targets.data<int32_t>()[5] = -100;
  const float scale = 1.0f / static_cast<float>(micro * seq);

  std::vector<std::unique_ptr<Nf4FrozenBase>> bases;
  std::vector<std::unique_ptr<LoraAdapters>> ranks;
  for (int r = 0; r < t; ++r) {
    bases.push_back(std::make_unique<Nf4FrozenBase>(m, Device::CPU, DType::F32, std::vector<PipelineStage>{},
                                                    ExpertShard{}, TensorParallelShard{r, t}));
    bases.back()->initialize(5);
    ranks.push_back(trained_adapters(m, lora, micro * seq, *bases.back(), {r, t}));
  }
  // One rank's LoRA over the base the ranks' dequantized shards make, and one device's QLoRA.
  FlatParameters shards_base = assembled(m, bases);
  auto over_shards = trained_adapters(m, plain, micro * seq, shards_base);
  FlatParameters host(m);
  host.initialize(5);
  Nf4FrozenBase one_base(host, Device::CPU, DType::F32);
  auto one_device = trained_adapters(m, lora, micro * seq, one_base);
  DecoderLM whole(m, micro, seq, Device::CPU, DType::F32, mode);
  over_shards->discard();
  const LossSum reference = whole.forward_backward(tokens, targets, *over_shards, *over_shards, scale);
  one_device->discard();
  const LossSum qlora_one = whole.forward_backward(tokens, targets, *one_device, *one_device, scale);

  std::vector<LossSum> losses(static_cast<size_t>(t));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(t, [&](int r) {
    auto group = create_process_group(testing::env_of(r, t, port), options);
    GroupTensorParallel tp(*group);
    const size_t k = static_cast<size_t>(r);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, mode, nullptr, &tp);
    ranks[k]->discard();
    losses[k] = model.forward_backward(tokens, targets, *ranks[k], *ranks[k], scale);
    ranks[k]->spread_shard_gradients();
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  double loss_gap = 0.0, gradient_gap = 0.0, one_device_gradient_gap = 0.0;
  for (int r = 0; r < t; ++r) {
    EXPECT_EQ(losses[static_cast<size_t>(r)].tokens, reference.tokens);
    const double gap = std::abs(losses[static_cast<size_t>(r)].sum - reference.sum) / std::abs(reference.sum);
    loss_gap = std::max(loss_gap, gap);
    EXPECT_LT(gap, 1e-5) << "rank " << r;
  }
  const double one_device_loss_gap = std::abs(losses[0].sum - qlora_one.sum) / std::abs(qlora_one.sum);
  const std::vector<std::string> names = over_shards->master_names();
  for (size_t i = 0; i < over_shards->gradients().size(); ++i) {
    const Tensor& expected = over_shards->gradients()[i];
    Tensor sum = Tensor::zeros(expected.shape());
    for (int r = 0; r < t; ++r) {  // the trainer's all-reduce over the tensor-parallel group
      const Tensor& g = ranks[static_cast<size_t>(r)]->gradients()[i];
      for (int64_t j = 0; j < g.numel(); ++j) sum.data<float>()[j] += g.data<float>()[j];
    }
    const double gap = relative_gap(sum, expected);
    gradient_gap = std::max(gradient_gap, gap);
    EXPECT_LT(gap, 2e-5) << names[i] << "'s gradient summed over the ranks";
    one_device_gradient_gap = std::max(one_device_gradient_gap, relative_gap(sum, one_device->gradients()[i]));
  }
  std::printf("QLoRA on %d tensor-parallel ranks (checkpointing %d): against LoRA on their dequantized shards loss "
              "gap %.3g, adapter gradient gap %.3g; against one device's QLoRA loss gap %.3g, adapter gradient gap "
              "%.3g\n",
              t, static_cast<int>(mode), loss_gap, gradient_gap, one_device_loss_gap, one_device_gradient_gap);
  EXPECT_LT(one_device_loss_gap, 1e-3);
  EXPECT_LT(one_device_gradient_gap, 5e-2);
}

TEST(ModelQloraTensorParallel, TwoRanksMatchLoraOnTheirDequantizedShards) {
  expect_qlora_ranks_match(ActivationCheckpoint::None);
  expect_qlora_ranks_match(ActivationCheckpoint::Full);
}

}  // namespace
}  // namespace forge
