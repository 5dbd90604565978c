// Context parallelism in the model (NOTE [Context parallelism] in model/context_parallel.h):
// C ranks (threads of this process over the CPU process group), each handed the same
// micro-batch and computing on its two chunks of every sequence, all report the loss one
// rank gives with the whole micro-batch, and their gradients summed over the ranks are that
// rank's. Llama (GQA) and MHA shapes, a sliding window that reaches across chunks, tied
// embeddings, every activation-checkpointing mode, 2 and 4 ranks, and tensor parallelism
// with it (2 x 2 ranks, async too); packed examples (NOTE [Chunk attention with packed examples]) that
// cross the ranks' chunks, with and without a window. Then the chunks a rank takes, and the
// inputs it refuses.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "cli/config.h"
#include "distributed/context_parallel_group.h"
#include "distributed/tensor_parallel_group.h"
#include "expect_error.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;
using testing::shard_of;

struct Case {
  std::string model;
  int ranks;  // C
  ActivationCheckpoint mode = ActivationCheckpoint::None;
  int tensor_parallel = 1;  // T: T x C ranks
  ConfigOverrides overrides = {};
  bool packed = false;  // a sequence layout of packed examples, handed to every rank
  ContextParallelRotate rotate = ContextParallelRotate::AllGather;  // NOTE [Ring attention]
  bool async_tensor_parallel = false;  // NOTE [Async tensor parallelism] in model/sequence_parallel.h
};

// Packed examples of micro-batches [2, 16] (a run of equal segment ids is one example;
// positions restart with each): row 0 holds examples of 5, 6 and 3 tokens and 2 of padding,
// row 1 one of 11 and one of 5. On 2 ranks (chunks of 4) and 4 (chunks of 2) they cross
// chunks and ranks; row 1's first is longer than a rank's two chunks.
SequenceLayout packed_layout() {
  const std::vector<std::vector<int32_t>> runs = {{5, 6, 3, 2}, {11, 5}};
  SequenceLayout layout{Tensor::empty({2, 16}, DType::I32), Tensor::empty({2, 16}, DType::I32)};
  int32_t id = 0;
  for (int64_t b = 0; b < 2; ++b) {
    int64_t t = 0;
    for (int32_t n : runs[static_cast<size_t>(b)]) {
      for (int32_t i = 0; i < n; ++i, ++t) {
        layout.positions.data<int32_t>()[b * 16 + t] = i;
        layout.segments.data<int32_t>()[b * 16 + t] = id;
      }
      ++id;
    }
  }
  return layout;
}

void expect_ranks_match_one(const Case& c) {
  SCOPED_TRACE(fmt::format("{} on {} context-parallel x {} tensor-parallel ranks, checkpointing {}{}{}{}", c.model,
                           c.ranks, c.tensor_parallel, static_cast<int>(c.mode), c.packed ? ", packed examples" : "",
                           c.rotate == ContextParallelRotate::Ring ? ", ring attention" : "",
                           c.async_tensor_parallel ? ", async tensor parallelism" : ""));
  ConfigOverrides overrides = c.overrides;
  overrides.push_back({"model.name", c.model});
  const ModelConfig m = load_experiment("", overrides).model;
  const int64_t micro = 2, seq = 16;
  const int cp = c.ranks, tp = c.tensor_parallel, world = cp * tp;
  const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 21);
  Tensor targets = testing::random_tokens(micro, seq, m.vocab_size, 22);
  targets.data<int32_t>()[5] = -100;  // masked positions, in two ranks' chunks
  targets.data<int32_t>()[seq + 14] = -100;
  const float scale = 1.0f / static_cast<float>(micro * seq);
  const SequenceLayout packed = packed_layout();
  const SequenceLayout* layout = c.packed ? &packed : nullptr;

  FlatParameters params(m), reference_grads(m);
  params.initialize(5);
  DecoderLM one(m, micro, seq, Device::CPU, DType::F32, c.mode);
  const LossSum reference = one.forward_backward(tokens, targets, params, reference_grads, scale, layout);

  // World rank w is tensor-parallel rank w % T of context-parallel rank w / T.
  std::vector<std::unique_ptr<FlatParameters>> weights, grads;
  for (int w = 0; w < world; ++w) {
    const TensorParallelShard shard{w % tp, tp};
    weights.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, shard));
    weights.back()->initialize(5);
    grads.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, shard));
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
    context_parallel.set_rotate_method(c.rotate);
    tensor_parallel.set_async(c.async_tensor_parallel);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, c.mode, nullptr, &tensor_parallel, &context_parallel);
    const size_t k = static_cast<size_t>(w);
    losses[k] = model.forward_backward(tokens, targets, *weights[k], *grads[k], scale, layout);
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  for (int w = 0; w < world; ++w) {  // every rank's loss is the micro-batch's
    EXPECT_EQ(losses[static_cast<size_t>(w)].tokens, reference.tokens);
    EXPECT_NEAR(losses[static_cast<size_t>(w)].sum, reference.sum, 1e-5 * std::abs(reference.sum)) << "rank " << w;
  }
  // The gradients of the ranks of one tensor-parallel rank, summed: its shard of the whole's.
  for (size_t s = 0; s < params.specs().size(); ++s) {
    const ParamSpec& spec = params.specs()[s];
    for (int t = 0; t < tp; ++t) {
      Tensor sum = Tensor::zeros(grads[static_cast<size_t>(t)]->tensors()[s].shape());
      for (int r = 0; r < cp; ++r) {
        const Tensor& g = grads[static_cast<size_t>(r * tp + t)]->tensors()[s];
        for (int64_t i = 0; i < g.numel(); ++i) sum.data<float>()[i] += g.data<float>()[i];
      }
      EXPECT_LT(relative_gap(sum, shard_of(reference_grads.tensors()[s], spec, {t, tp})), 2e-5)
          << spec.name << "'s gradient summed over the context-parallel ranks of tensor-parallel rank " << t;
    }
  }
}

TEST(ModelContextParallel, TwoRanksMatchOneInEveryCheckpointingMode) {
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny", 2, mode});
}

TEST(ModelContextParallel, FourRanksMhaWindowAndTiedEmbeddings) {
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny-mha", 4, mode});
  expect_ranks_match_one({"debug-tiny", 4, ActivationCheckpoint::Selective});
  // A window of 5 positions: queries see keys of the chunk before theirs, on other ranks.
  expect_ranks_match_one({"debug-tiny-swa", 4, ActivationCheckpoint::None, 1, {{"model.sliding_window", "5"}}});
  expect_ranks_match_one({"debug-tiny-swa", 2, ActivationCheckpoint::Full, 1, {{"model.sliding_window", "3"}}});
  expect_ranks_match_one({"debug-tiny", 2, ActivationCheckpoint::None, 1, {{"model.tie_word_embeddings", "true"}}});
}

TEST(ModelContextParallel, WithTensorParallelism) {
  expect_ranks_match_one({"debug-tiny", 2, ActivationCheckpoint::None, 2});
  expect_ranks_match_one({"debug-tiny-mha", 2, ActivationCheckpoint::Full, 2});
}

// NOTE [Async tensor parallelism]: the tensor-parallel collectives as ring steps under the
// GEMMs' row chunks, on each context-parallel rank's tokens, with either rotate method.
TEST(ModelContextParallel, WithAsyncTensorParallelism) {
  Case c{"debug-tiny", 2, ActivationCheckpoint::Selective, 2};
  c.async_tensor_parallel = true;
  expect_ranks_match_one(c);
  c.rotate = ContextParallelRotate::Ring;
  c.mode = ActivationCheckpoint::Full;
  expect_ranks_match_one(c);
}

// NOTE [Ring attention]: the same losses and gradients with the keys and values passed
// around the ring, GQA and MHA, 2 and 4 ranks, every checkpointing mode, with tensor
// parallelism, with sliding windows.
TEST(ModelContextParallel, RingAttentionMatchesOneRank) {
  constexpr ContextParallelRotate ring = ContextParallelRotate::Ring;
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny", 2, mode, 1, {}, false, ring});
  expect_ranks_match_one({"debug-tiny-mha", 4, ActivationCheckpoint::None, 1, {}, false, ring});
  expect_ranks_match_one({"debug-tiny", 4, ActivationCheckpoint::Full, 1, {}, false, ring});
  expect_ranks_match_one({"debug-tiny", 2, ActivationCheckpoint::Selective, 2, {}, false, ring});
  // NOTE [Ring attention with a sliding window]: chunks of 2 under a window of 5 (full pairs,
  // bands), of 4 under 3 (trimmed bands) and 6 (bands, trimmed bands), with tensor parallelism.
  expect_ranks_match_one(
      {"debug-tiny-swa", 4, ActivationCheckpoint::None, 1, {{"model.sliding_window", "5"}}, false, ring});
  expect_ranks_match_one(
      {"debug-tiny-swa", 2, ActivationCheckpoint::Full, 1, {{"model.sliding_window", "3"}}, false, ring});
  expect_ranks_match_one(
      {"debug-tiny-swa", 2, ActivationCheckpoint::Selective, 2, {{"model.sliding_window", "6"}}, false, ring});
}

// NOTE [Chunk attention with packed examples]: the queries of each rank's chunks see their
// examples' keys on every rank, and nothing of the other examples.
TEST(ModelContextParallel, PackedExamplesAcrossTheRanksChunks) {
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny", 2, mode, 1, {}, true});
  expect_ranks_match_one({"debug-tiny-mha", 4, ActivationCheckpoint::None, 1, {}, true});
  expect_ranks_match_one(
      {"debug-tiny-swa", 4, ActivationCheckpoint::Selective, 1, {{"model.sliding_window", "3"}}, true});
  expect_ranks_match_one({"debug-tiny", 2, ActivationCheckpoint::None, 2, {}, true});  // with tensor parallelism
}

// NOTE [Ring attention with packed examples]: the same under the ring, 2 and 4 ranks, every
// checkpointing mode, GQA and MHA, with tensor parallelism (a window with packed examples is
// refused: ContextParallelRingPacked.RingRefusesAWindowWithPackedExamples).
TEST(ModelContextParallel, RingAttentionWithPackedExamplesMatchesOneRank) {
  constexpr ContextParallelRotate ring = ContextParallelRotate::Ring;
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny", 2, mode, 1, {}, true, ring});
  expect_ranks_match_one({"debug-tiny-mha", 4, ActivationCheckpoint::None, 1, {}, true, ring});
  expect_ranks_match_one({"debug-tiny", 4, ActivationCheckpoint::Full, 1, {}, true, ring});
  expect_ranks_match_one({"debug-tiny", 2, ActivationCheckpoint::Selective, 2, {}, true, ring});
}

// Rank 1 of 2 holds chunks 1 and 2 of 4: positions [2, 4) and [4, 6) of rows of 8, chunk
// 1 of every row first.
TEST(ModelContextParallel, RanksTakeTheirChunksChunkMajor) {
  Tensor rows = Tensor::empty({2, 8}, DType::I32);
  for (int32_t i = 0; i < 16; ++i) rows.data<int32_t>()[i] = i;
  Tensor local = Tensor::empty({4, 2}, DType::I32);
  take_chunks(local, rows, 1, 2);
  EXPECT_EQ(std::vector<int32_t>(local.data<int32_t>(), local.data<int32_t>() + 8),
            (std::vector<int32_t>{2, 3, 10, 11, 4, 5, 12, 13}));
  Tensor back = Tensor::zeros({2, 8}, DType::I32);
  put_chunks(back, local, 1, 2);
  EXPECT_EQ(std::vector<int32_t>(back.data<int32_t>(), back.data<int32_t>() + 16),
            (std::vector<int32_t>{0, 0, 2, 3, 4, 5, 0, 0, 0, 0, 10, 11, 12, 13, 0, 0}));
  EXPECT_EQ(context_parallel_chunk(0, 4, 1), 7);
  EXPECT_EQ(context_parallel_chunk(3, 4, 1), 4);
}

// A group that is never reached: the decoder refuses these inputs before any collective.
class Unreachable final : public ContextParallel {
 public:
  explicit Unreachable(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  void gather(const Tensor&, const Tensor&) override { FORGE_FAIL("unexpected gather"); }
  void reduce_scatter(const Tensor&, const Tensor&) override { FORGE_FAIL("unexpected reduce_scatter"); }
  void all_reduce_sum(const Tensor&) override { FORGE_FAIL("unexpected all_reduce_sum"); }
  void rotate_start(const std::vector<Tensor>&, const std::vector<Tensor>&) override {
    FORGE_FAIL("unexpected rotate_start");
  }

 private:
  int size_;
};

TEST(ModelContextParallel, RefusesWhatItCannotSplit) {
  const ModelConfig tiny = load_experiment("", {{"model.name", "debug-tiny"}}).model;
  Unreachable four(4);
  expect_error(
      [&] { DecoderLM(tiny, 1, 12, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr, &four); },
      {"context parallelism over 4 ranks", "8 chunks", "training.seq_len = 12"});
  for (const char* name : {"debug-tiny-moe", "debug-tiny-mla"}) {
    const ModelConfig m = load_experiment("", {{"model.name", name}}).model;
    expect_error(
        [&] { DecoderLM(m, 1, 16, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr, &four); },
        {"context parallelism over 4 ranks", name, "dense Llama-family"});
    expect_error([&] { activation_bytes(m, 1, 16, DType::F32, ActivationCheckpoint::None, 1, 1, 4); },
                 {"context parallelism over 4 ranks", name});
  }
  DecoderLM model(tiny, 2, 16, Device::CPU, DType::F32, ActivationCheckpoint::Selective, nullptr, nullptr, &four);
  EXPECT_EQ(model.arena_bytes(), activation_bytes(tiny, 2, 16, DType::F32, ActivationCheckpoint::Selective, 1, 1, 4));
  EXPECT_LT(model.arena_bytes(), activation_bytes(tiny, 2, 16, DType::F32, ActivationCheckpoint::Selective));
  {  // The ring's scratch (NOTE [Ring attention]) is what forge info counts for it.
    Unreachable ring(4);
    ring.set_rotate_method(ContextParallelRotate::Ring);
    DecoderLM ring_model(tiny, 2, 16, Device::CPU, DType::F32, ActivationCheckpoint::Selective, nullptr, nullptr,
                         &ring);
    EXPECT_EQ(ring_model.arena_bytes(), activation_bytes(tiny, 2, 16, DType::F32, ActivationCheckpoint::Selective, 1,
                                                         1, 4, {}, ContextParallelRotate::Ring));
    EXPECT_NE(ring_model.arena_bytes(), model.arena_bytes());
  }
  FlatParameters params(tiny), grads(tiny);
  params.initialize(1);
  const Tensor tokens = testing::random_tokens(2, 16, tiny.vocab_size, 3);
  SequenceLayout packed = packed_layout();
  packed.positions.data<int32_t>()[3] = 16;
  expect_error([&] { model.forward_backward(tokens, tokens, params, grads, 1.0f, &packed); },
               {"sequence layout: position 16 of token 3 is outside [0, 16)"});
  Tensor logits = Tensor::empty({32, tiny.vocab_size});
  expect_error([&] { model.forward_logits(tokens, params, logits); }, {"forward_logits", "context parallelism"});
}

}  // namespace
}  // namespace forge
