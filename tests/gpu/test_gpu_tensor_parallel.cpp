// Tensor parallelism's CUDA path on one GPU (NOTE [Tensor parallelism] in
// model/tensor_parallel.h): T ranks as threads of this process, each with its bf16 shards
// and its DecoderLM on the same GPU, taking turns on it (one thread computes at a time;
// the turn passes at every collective, which the threads compute among themselves with
// device copies and fp32 accumulation). Their loss and each shard's gradients match one
// GPU's step of the whole model: the shard shapes, the row-parallel GEMMs split around the
// rank's rows, the shard embedding and the vocabulary-parallel cross-entropy in bf16, with
// cuBLASLt and cuDNN. (NCCL cannot put two ranks on one GPU; the multi-GPU runs are issue 23.)
#include <gtest/gtest.h>

#include <barrier>
#include <functional>
#include <future>
#include <mutex>

#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"

namespace forge::gpu_test {
namespace {

// The group's shared state: the turn (one thread on the GPU at a time), a barrier, and
// each rank's tensor of the collective in progress.
struct ThreadGroup {
  explicit ThreadGroup(int size) : barrier(size), posted(static_cast<size_t>(size)) {}
  std::mutex turn;
  std::barrier<> barrier;
  std::vector<const Tensor*> posted;
};

class ThreadTensorParallel final : public TensorParallel {
 public:
  ThreadTensorParallel(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(group_.posted.size()); }

  void gather_rows(const Tensor& full, const Tensor& local) override {
    collective(local, [&](int q, const Tensor& theirs) {
      const int64_t n = theirs.dim(0);
      copy_bytes(full.narrow(q * n, (q + 1) * n).raw(), Device::CUDA, theirs.raw(), Device::CUDA, theirs.nbytes());
    });
  }
  void reduce_scatter_rows(const Tensor& local, const Tensor& full) override {
    const int64_t n = local.dim(0);
    Tensor sum = Tensor::zeros(local.shape(), DType::F32, Device::CUDA);
    collective(full, [&](int, const Tensor& theirs) { accumulate(sum, theirs.narrow(rank_ * n, (rank_ + 1) * n)); });
    cast(local, sum);
  }
  void all_reduce_sum(const Tensor& tensor) override {
    reduce_on_host(tensor, [](float a, float b) { return a + b; });
  }
  void all_reduce_max(const Tensor& tensor) override {
    reduce_on_host(tensor, [](float a, float b) { return std::max(a, b); });
  }

  // The thread's turn on the GPU, taken before its first kernel and given back at the end.
  void begin() { group_.turn.lock(); }
  void end() {
    device_synchronize();
    group_.turn.unlock();
  }

 private:
  // Every rank posts `mine`; then each, in its turn, reads every rank's (rank order) with
  // `read`; no rank goes on (and overwrites its tensor) before every rank has read.
  void collective(const Tensor& mine, const std::function<void(int, const Tensor&)>& read) {
    device_synchronize();
    group_.posted[static_cast<size_t>(rank_)] = &mine;
    group_.turn.unlock();
    group_.barrier.arrive_and_wait();
    {
      std::lock_guard<std::mutex> lock(group_.turn);
      for (int q = 0; q < size(); ++q) read(q, *group_.posted[static_cast<size_t>(q)]);
      device_synchronize();
    }
    group_.barrier.arrive_and_wait();
    group_.turn.lock();
  }
  // fp32 tensors (the statistics): every rank's values combined on the host, in rank order.
  void reduce_on_host(const Tensor& tensor, float (*combine)(float, float)) {
    Tensor result;
    collective(tensor, [&](int q, const Tensor& theirs) {
      const Tensor host = theirs.to(Device::CPU);
      if (q == 0) {
        result = host;
        return;
      }
      for (int64_t i = 0; i < host.numel(); ++i)
        result.data<float>()[i] = combine(result.data<float>()[i], host.data<float>()[i]);
    });
    copy_bytes(tensor.raw(), Device::CUDA, result.raw(), Device::CPU, tensor.nbytes());
  }

  ThreadGroup& group_;
  int rank_;
};

// The whole parameter's values at the places rank `shard` holds.
Tensor shard_of(const Tensor& full, const ParamSpec& spec, TensorParallelShard shard) {
  Tensor out = Tensor::empty(tensor_parallel_spec(spec, shard).shape);
  for (const ShardRun& run : tensor_parallel_runs(spec, shard))
    std::copy(full.data<float>() + run.full_begin, full.data<float>() + run.full_begin + run.count,
              out.data<float>() + run.local_begin);
  return out;
}

ModelConfig llama_like(bool tied) {
  ModelConfig c;
  c.name = "gpu-tp-test";
  c.vocab_size = 1024;
  c.hidden_size = 256;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 512;
  c.max_seq_len = 256;
  c.rope_theta = 500000;
  c.init_std = 0.05;
  c.tie_word_embeddings = tied;
  return c;
}

void expect_ranks_match_one_gpu(int t, bool tied, ActivationCheckpoint mode) {
  SCOPED_TRACE(fmt::format("{} ranks, {}, checkpointing {}", t, tied ? "tied" : "untied",
                           activation_checkpoint_name(mode)));
  const ModelConfig c = llama_like(tied);
  const int64_t batch = 2, seq = 128;
  Rng rng(seed_for_current_test() + static_cast<uint64_t>(t));
  const Tensor tokens = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
  Tensor targets = random_ids(batch * seq, c.vocab_size, rng).view({batch, seq});
  targets.data<int32_t>()[7] = kIgnoreIndex;
  const float scale = 1.0f / static_cast<float>(batch * seq - 1);

  FlatParameters whole(c);
  whole.initialize(23);
  round_to_bf16(whole.flat());
  FlatParameters compute(c, Device::CUDA, DType::BF16), grads(c, Device::CUDA, DType::F32);
  compute.assign_from(whole);
  grads.zero();
  DecoderLM one(c, batch, seq, Device::CUDA, DType::BF16, mode);
  const LossSum reference =
      one.forward_backward(tokens.to(Device::CUDA), targets.to(Device::CUDA), compute, grads, scale);

  ThreadGroup group(t);
  std::vector<LossSum> losses(static_cast<size_t>(t));
  std::vector<std::unique_ptr<FlatParameters>> shard_grads;
  for (int r = 0; r < t; ++r)
    shard_grads.push_back(std::make_unique<FlatParameters>(c, Device::CUDA, DType::F32, TensorParallelShard{r, t}));
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < t; ++r)
    ranks.push_back(std::async(std::launch::async, [&, r]() -> std::string {
      ThreadTensorParallel tp(group, r);
      tp.begin();
      try {
        FlatParameters host(c, Device::CPU, DType::F32, TensorParallelShard{r, t});
        host.initialize(23);
        round_to_bf16(host.flat());
        FlatParameters weights(c, Device::CUDA, DType::BF16, TensorParallelShard{r, t});
        weights.assign_from(host);
        shard_grads[static_cast<size_t>(r)]->zero();
        DecoderLM model(c, batch, seq, Device::CUDA, DType::BF16, mode, nullptr, &tp);
        losses[static_cast<size_t>(r)] = model.forward_backward(tokens.to(Device::CUDA), targets.to(Device::CUDA),
                                                                weights, *shard_grads[static_cast<size_t>(r)], scale);
      } catch (const Error& e) {
        tp.end();
        return e.what();
      }
      tp.end();
      return "";
    }));
  for (auto& rank : ranks) ASSERT_EQ(rank.get(), "");

  const Tensor whole_grads = to_cpu_f32(grads.flat());
  for (int r = 0; r < t; ++r) {
    EXPECT_EQ(losses[static_cast<size_t>(r)].tokens, reference.tokens);
    EXPECT_NEAR(losses[static_cast<size_t>(r)].mean(), reference.mean(), 2e-3 * reference.mean()) << "rank " << r;
    for (size_t s = 0; s < whole.specs().size(); ++s) {
      const ParamSpec& spec = whole.specs()[s];
      const Tensor expected = shard_of(to_cpu_f32(grads.tensors()[s]), spec, {r, t});
      EXPECT_LT(relative_l2(to_cpu_f32(shard_grads[static_cast<size_t>(r)]->tensors()[s]), expected), 2e-2)
          << spec.name << " on rank " << r;
    }
  }
}

TEST(GpuTensorParallel, ThreadRanksMatchOneGpu) {
  expect_ranks_match_one_gpu(2, false, ActivationCheckpoint::None);
  expect_ranks_match_one_gpu(2, true, ActivationCheckpoint::Selective);
  expect_ranks_match_one_gpu(2, false, ActivationCheckpoint::Full);
}

}  // namespace
}  // namespace forge::gpu_test
