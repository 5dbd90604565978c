// Async tensor parallelism (NOTE [Async tensor parallelism] in model/sequence_parallel.h):
// the blocks' all-gathers and reduce-scatters as ring steps interleaved with row chunks of
// their GEMMs, on CPU ranks (threads of this process over the CPU process group, whose
// send_recv is done when it returns).
//   - SequenceParallelEdges alone, T = 2 and 4: the gathered GEMMs (the column-parallel
//     forward, the row-parallel projection's input gradient) and every weight gradient are
//     bitwise the non-async ones (a row of the CPU GEMM is the same dot products in any row
//     block); the reduce-scattered results (the row-parallel forward, the column-parallel
//     input gradient and the norm's backward after it) agree within fp32 reordering (the
//     ring sums from rank r + 1 round to r, the group's reduce-scatter in rank order).
//   - The model: T ranks with the key on give one rank's loss and, on each rank, its shards
//     of one rank's gradients (the bounds of the non-async tests), and the non-async ranks'
//     loss and gradients within fp32 reordering, in every checkpointing mode.
//   - The key: off by default, refused without tensor parallelism, with FP8 and with LoRA.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "cli/config.h"
#include "distributed/tensor_parallel_group.h"
#include "expect_error.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "model/sequence_parallel.h"
#include "model_testing.h"
#include "ops/rmsnorm.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;
using testing::shard_of;

ProcessGroupOptions quick_options() {
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  return options;
}

Tensor random_tensor(Shape shape, uint64_t seed) {
  Tensor t = Tensor::empty(std::move(shape));
  Rng rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal());
  return t;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// What one rank's edges give, each output of the four steps.
struct EdgeResults {
  Tensor y, out, d_in, out_weight_grad, d_hidden, in_weight_grad, d_stream, norm_grad;
};

// One rank of T: the four edges of a component (hidden H, column-parallel out/T columns,
// row-parallel K/T columns) on its rows of the micro-batch's N tokens, async or not.
EdgeResults run_edges(TensorParallel& tp, bool async) {
  const int t = tp.size(), r = tp.rank();
  const int64_t micro = 2, seq = 8, hidden = 16, columns = 24, rows = micro * seq, n = rows / t;
  tp.set_async(async);
  SequenceParallelEdges edges;
  edges.set_group(&tp);
  const StepShape shape{micro, seq, DType::F32, 1, t, 1};
  ArenaLayout measure(nullptr, Device::CPU);
  edges.lay_out(measure, shape, hidden);
  const Tensor arena = Tensor::zeros({measure.bytes() / 4 + 1});
  ArenaLayout layout(arena.raw(), Device::CPU);
  edges.lay_out(layout, shape, hidden);

  const uint64_t seed = 100 * static_cast<uint64_t>(r);
  const Tensor x = random_tensor({n, hidden}, seed + 1), norm_weight = random_tensor({hidden}, 7);
  const Tensor normed = Tensor::empty({n, hidden}), rstd = Tensor::empty({n});
  rmsnorm_forward(normed, rstd, x, norm_weight, 1e-5f);
  const LinearWeight w_in{random_tensor({columns, hidden}, seed + 2)};
  const LinearWeight w_out{random_tensor({hidden, columns}, seed + 3)};
  EdgeResults e;
  e.y = Tensor::empty({rows, columns});
  edges.project_in(e.y, normed, w_in);
  e.out = Tensor::empty({n, hidden});
  edges.project_out(e.out, e.y, w_out, x);
  const Tensor d_stream_in = random_tensor({n, hidden}, seed + 4), dy = random_tensor({rows, columns}, seed + 5);
  e.d_in = Tensor::empty({rows, columns});
  e.out_weight_grad = Tensor::zeros({hidden, columns});
  edges.project_out_backward(e.d_in, LinearWeight{e.out_weight_grad}, d_stream_in, e.y, w_out, true);
  e.d_hidden = Tensor::empty({n, hidden});
  e.in_weight_grad = Tensor::zeros({columns, hidden});
  e.d_stream = Tensor::zeros({n, hidden});  // the norm's backward adds into the stream's gradient
  e.norm_grad = Tensor::zeros({hidden});
  edges.normed_projection_backward(e.d_hidden, LinearWeight{e.in_weight_grad}, dy, normed, w_in, true, e.d_stream,
                                   e.norm_grad, x, norm_weight, rstd);
  return e;
}

void expect_edges_match(int t) {
  SCOPED_TRACE(fmt::format("{} ranks", t));
  std::vector<EdgeResults> plain(static_cast<size_t>(t)), ring(static_cast<size_t>(t));
  const int port = testing::free_port();
  const auto errors = testing::run_ranks(t, [&](int r) {
    auto group = create_process_group(testing::env_of(r, t, port), quick_options());
    GroupTensorParallel tp(*group);
    plain[static_cast<size_t>(r)] = run_edges(tp, false);
    ring[static_cast<size_t>(r)] = run_edges(tp, true);
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < t; ++r) {
    const EdgeResults &a = plain[static_cast<size_t>(r)], &b = ring[static_cast<size_t>(r)];
    EXPECT_TRUE(bitwise_equal(a.y, b.y)) << "the column-parallel forward on rank " << r;
    EXPECT_TRUE(bitwise_equal(a.d_in, b.d_in)) << "the row-parallel input gradient on rank " << r;
    EXPECT_TRUE(bitwise_equal(a.out_weight_grad, b.out_weight_grad)) << "the row-parallel weight gradient, rank " << r;
    EXPECT_TRUE(bitwise_equal(a.in_weight_grad, b.in_weight_grad)) << "the column-parallel weight gradient, rank " << r;
    EXPECT_LT(relative_gap(b.out, a.out), 1e-6) << "the reduce-scattered forward on rank " << r;
    EXPECT_LT(relative_gap(b.d_hidden, a.d_hidden), 1e-6) << "the reduce-scattered input gradient on rank " << r;
    EXPECT_LT(relative_gap(b.d_stream, a.d_stream), 1e-6) << "the norm's input gradient on rank " << r;
    EXPECT_LT(relative_gap(b.norm_grad, a.norm_grad), 1e-6) << "the norm's weight gradient on rank " << r;
  }
}

TEST(ModelAsyncTensorParallel, EdgesMatchTheCollectives) {
  expect_edges_match(2);
  expect_edges_match(4);
}

// T ranks of `model` with the key on and off: each against one rank (its loss, its
// gradients' shards), and the two against each other.
void expect_async_ranks_match(const std::string& model, int t, ActivationCheckpoint mode, bool tied = false) {
  SCOPED_TRACE(fmt::format("{} on {} ranks, checkpointing {}{}", model, t, static_cast<int>(mode),
                           tied ? ", tied embeddings" : ""));
  ConfigOverrides overrides = {{"model.name", model}};
  if (tied) overrides.push_back({"model.tie_word_embeddings", "true"});
  const ModelConfig m = load_experiment("", overrides).model;
  const int64_t micro = 2, seq = 8;
  const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 11);
  Tensor targets = testing::random_tokens(micro, seq, m.vocab_size, 12);
  targets.data<int32_t>()[3] = -100;
  const float scale = 1.0f / static_cast<float>(micro * seq);

  FlatParameters params(m), reference_grads(m);
  params.initialize(5);
  DecoderLM one(m, micro, seq, Device::CPU, DType::F32, mode);
  const LossSum reference = one.forward_backward(tokens, targets, params, reference_grads, scale);

  // [async][rank]
  std::vector<std::unique_ptr<FlatParameters>> weights, grads[2];
  for (int r = 0; r < t; ++r) {
    weights.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{r, t}));
    weights.back()->initialize(5);
    for (auto& g : grads)
      g.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{r, t}));
  }
  std::vector<LossSum> losses[2] = {std::vector<LossSum>(static_cast<size_t>(t)),
                                    std::vector<LossSum>(static_cast<size_t>(t))};
  const int port = testing::free_port();
  const auto errors = testing::run_ranks(t, [&](int r) {
    auto group = create_process_group(testing::env_of(r, t, port), quick_options());
    GroupTensorParallel tp(*group);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, mode, nullptr, &tp);
    for (int async = 0; async < 2; ++async) {
      tp.set_async(async == 1);
      const size_t k = static_cast<size_t>(r);
      losses[async][k] = model.forward_backward(tokens, targets, *weights[k], *grads[async][k], scale);
    }
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  double loss_gap = 0.0, gradient_gap = 0.0;
  for (int r = 0; r < t; ++r) {
    const size_t k = static_cast<size_t>(r);
    EXPECT_EQ(losses[1][k].tokens, reference.tokens);
    EXPECT_NEAR(losses[1][k].sum, reference.sum, 1e-5 * std::abs(reference.sum)) << "rank " << r;
    EXPECT_NEAR(losses[1][k].sum, losses[0][k].sum, 1e-6 * std::abs(reference.sum)) << "rank " << r;
    loss_gap = std::max(loss_gap, std::abs(losses[1][k].sum - losses[0][k].sum) / std::abs(reference.sum));
    for (size_t s = 0; s < params.specs().size(); ++s) {
      const ParamSpec& spec = params.specs()[s];
      const Tensor& got = grads[1][k]->tensors()[s];
      EXPECT_LT(relative_gap(got, shard_of(reference_grads.tensors()[s], spec, {r, t})), 2e-5)
          << spec.name << "'s gradient on rank " << r;
      const double gap = relative_gap(got, grads[0][k]->tensors()[s]);
      gradient_gap = std::max(gradient_gap, gap);
      EXPECT_LT(gap, 2e-6) << spec.name << "'s gradient on rank " << r << " against the non-async ranks";
    }
  }
  std::printf("async tensor parallelism, %s on %d ranks: against the non-async ranks, loss gap %.3g, largest "
              "gradient gap %.3g\n",
              model.c_str(), t, loss_gap, gradient_gap);
}

TEST(ModelAsyncTensorParallel, TwoRanksMatchInEveryCheckpointingMode) {
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_async_ranks_match("debug-tiny", 2, mode);
}

TEST(ModelAsyncTensorParallel, FourRanksMhaTied) {
  expect_async_ranks_match("debug-tiny-mha", 4, ActivationCheckpoint::None);
  expect_async_ranks_match("debug-tiny-mha", 4, ActivationCheckpoint::Full, true);
}

TEST(ModelAsyncTensorParallel, ConfigKeyIsCheckedUpFront) {
  const ConfigOverrides tp2 = {{"parallelism.tensor_parallel_degree", "2"},
                               {"parallelism.data_parallel_shard_degree", "1"}};
  auto with = [&](ConfigOverrides more) {
    ConfigOverrides all = tp2;
    all.insert(all.end(), more.begin(), more.end());
    return load_experiment("", all);
  };
  const std::string key = "parallelism.enable_async_tensor_parallel";
  EXPECT_FALSE(with({}).parallelism.enable_async_tensor_parallel);
  EXPECT_TRUE(with({{key, "true"}}).parallelism.enable_async_tensor_parallel);
  expect_error([&] { load_experiment("", {{key, "true"}}); },
               {key + " = true", "parallelism.tensor_parallel_degree > 1"});
  expect_error([&] { with({{key, "true"}, {"precision.fp8", "tensorwise"}}); },
               {key + " = true", "precision.fp8 = tensorwise"});
  expect_error([&] { with({{key, "true"}, {"lora.rank", "8"}}); }, {key + " = true", "lora.rank = 8", "LoRA"});
}

}  // namespace
}  // namespace forge
