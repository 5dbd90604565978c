// Expert parallelism's CUDA path on one GPU (NOTE [Expert parallelism] in
// model/expert_dispatch.h, NOTE [Expert exchange overlap] in model/moe_feed_forward.cpp): P
// ranks as threads of this process, each with its DecoderLM, its micro-batch and its local
// experts on the same GPU, dispatching through GroupExpertDispatch, the trainer's, over a
// process group whose all-to-all the threads make among themselves with device copies on
// the stream they are handed (NCCL cannot put two ranks on one GPU; the multi-GPU runs are
// issue 23). So the exchanges run on the dispatch's own stream, ordered by events only, while
// the shared experts' GEMMs run on the compute stream; nothing synchronizes the host but the
// count exchange. Each all-to-all first fills the rows it receives with NaN and holds its
// stream back (a large memset) before it copies, so a layer that read received rows before
// waiting for the exchange, or wrote rows still being sent, would show in the loss or the
// gradients. The ranks' losses and gradients match those of the same ranks with every
// exchange on the compute stream (the order before the overlap), and their losses add up to
// one GPU's step on all their tokens.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <memory>
#include <mutex>

#include "../cpu/parallel_testing.h"
#include "distributed/expert_dispatch_group.h"
#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"

namespace forge::gpu_test {
namespace {

void cuda_ok(cudaError_t status, const char* what) {
  FORGE_CHECK(status == cudaSuccess, "{}: {}", what, cudaGetErrorString(status));
}

// What the rank threads of one all-to-all post for each other.
struct ThreadExchange {
  explicit ThreadExchange(int size) : barrier(size), posts(static_cast<size_t>(size)) {}
  struct Post {
    const Tensor* input = nullptr;
    std::vector<int64_t> send;
    cudaEvent_t ready = nullptr, done = nullptr;
  };
  RankBarrier barrier;
  std::vector<Post> posts;
};

// A process group of rank threads with all_to_all only (what GroupExpertDispatch calls),
// asynchronous on the stream it is given: rank q's rows for this rank are copied on this
// rank's stream after q's stream reached its all-to-all (an event), and this rank's stream
// goes on only after every rank copied its rows (their events), as NCCL's all-to-all
// orders the ranks' streams. The host of each thread waits only for the other threads to
// post (the GPU's turn passes meanwhile), never for the GPU.
class ThreadAllToAll final : public ProcessGroup {
 public:
  static constexpr size_t kDelayBytes = size_t{1} << 30;  // about 0.3 ms of memset on an H200

  ThreadAllToAll(std::mutex& turn, ThreadExchange& exchange, int rank)
      : turn_(turn), exchange_(exchange), rank_(rank) {
    cuda_ok(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    cuda_ok(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
    delay_ = Tensor::empty({static_cast<int64_t>(kDelayBytes)}, DType::U8, Device::CUDA);
  }
  ~ThreadAllToAll() override {
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(exchange_.posts.size()); }

  void all_to_all(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                  const std::vector<int64_t>& send_counts, CudaStream stream) override {
    check_all_to_all(output, recv_counts, input, send_counts, world_size(), Device::CUDA);
    const auto s = reinterpret_cast<cudaStream_t>(stream);
    const size_t row = static_cast<size_t>(row_elements(output)) * dtype_size(output.dtype());
    int64_t received = 0;
    for (int64_t c : recv_counts) received += c;
    // Nothing has arrived yet: NaN rows (0xff bytes in every float dtype), then a wait.
    cuda_ok(cudaMemsetAsync(output.raw(), 0xff, static_cast<size_t>(received) * row, s), "cudaMemsetAsync");
    cuda_ok(cudaMemsetAsync(delay_.raw(), 0, kDelayBytes, s), "cudaMemsetAsync");
    cuda_ok(cudaEventRecord(ready_, s), "cudaEventRecord");
    exchange_.posts[static_cast<size_t>(rank_)] = {&input, send_counts, ready_, done_};
    pass();
    size_t at = 0;
    for (int q = 0; q < world_size(); ++q) {
      const ThreadExchange::Post& theirs = exchange_.posts[static_cast<size_t>(q)];
      int64_t first = 0;  // q's rows for this rank start after its rows for ranks [0, rank)
      for (int j = 0; j < rank_; ++j) first += theirs.send[static_cast<size_t>(j)];
      const size_t bytes = static_cast<size_t>(recv_counts[static_cast<size_t>(q)]) * row;
      cuda_ok(cudaStreamWaitEvent(s, theirs.ready, 0), "cudaStreamWaitEvent");
      if (bytes > 0)
        cuda_ok(cudaMemcpyAsync(static_cast<char*>(output.raw()) + at,
                                static_cast<const char*>(theirs.input->raw()) + static_cast<size_t>(first) * row, bytes,
                                cudaMemcpyDeviceToDevice, s),
                "cudaMemcpyAsync");
      at += bytes;
    }
    cuda_ok(cudaEventRecord(done_, s), "cudaEventRecord");
    pass();
    for (int q = 0; q < world_size(); ++q)  // every rank has copied this rank's rows
      if (q != rank_) cuda_ok(cudaStreamWaitEvent(s, exchange_.posts[static_cast<size_t>(q)].done, 0), "wait");
    pass();  // no rank posts again before every rank read the posts
  }

  void all_reduce(const Tensor&, ReduceOp, CudaStream) override { unused("all_reduce"); }
  void reduce_scatter(const Tensor&, const Tensor&, ReduceOp, CudaStream) override { unused("reduce_scatter"); }
  void all_gather(const Tensor&, const Tensor&, CudaStream) override { unused("all_gather"); }
  void send_recv(const std::vector<PointToPoint>&, CudaStream) override { unused("send_recv"); }
  void barrier() override { unused("barrier"); }
  void destroy() override {}
  std::unique_ptr<ProcessGroup> split(int, int) override {
    unused("split");
    return nullptr;
  }

 private:
  static void unused(const char* what) { FORGE_CHECK(false, "ThreadAllToAll: {} is not part of this test", what); }
  // Every rank thread gets here before any goes on; the GPU's turn passes meanwhile.
  void pass() { exchange_.barrier.pass(turn_); }

  std::mutex& turn_;
  ThreadExchange& exchange_;
  int rank_;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  Tensor delay_;
};

// The reference ordering: the same exchanges enqueued on the compute stream, each before
// anything that follows it, as before the overlap.
class ComputeStreamDispatch final : public ExpertDispatch {
 public:
  explicit ComputeStreamDispatch(ProcessGroup& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send, int64_t per_rank) override {
    const int64_t p = size();
    const Tensor sent = Tensor::empty({p, per_rank}, DType::I64, Device::CUDA);
    const Tensor received = Tensor::empty({p, per_rank}, DType::I64, Device::CUDA);
    copy_bytes(sent.raw(), Device::CUDA, send.data(), Device::CPU, send.size() * sizeof(int64_t));
    const std::vector<int64_t> one_row_each(static_cast<size_t>(p), 1);
    group_.all_to_all(received, one_row_each, sent, one_row_each, nullptr);
    std::vector<int64_t> counts(send.size());
    copy_bytes(counts.data(), Device::CPU, received.raw(), Device::CUDA, counts.size() * sizeof(int64_t));
    return counts;
  }
  void exchange_rows_start(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                           const std::vector<int64_t>& send_counts) override {
    group_.all_to_all(output, recv_counts, input, send_counts, nullptr);
  }

 private:
  ProcessGroup& group_;
};

// P expert-parallel rank threads (each its own micro-batch of `micro` sequences), dispatching
// through GroupExpertDispatch (the exchanges on its stream, the shared experts beside them),
// against the same rank threads with every exchange on the compute stream: the same
// routings (each rank's forward is the same kernels on the same rows), so the same losses and
// gradients, up to the order of the backward's atomic additions. And against one GPU on all
// P micro-batches: the losses add up to its loss (routing near-ties may fall otherwise in a
// GEMM of other rows, so the gradients are compared only between the two orderings).
void expect_expert_parallel_ranks_match(int p, ActivationCheckpoint mode) {
  SCOPED_TRACE(fmt::format("expert parallelism {}, checkpointing {}", p, activation_checkpoint_name(mode)));
  ModelConfig config = small_deepseek(false);  // 16 experts, 3 per token, 2 shared
  config.router_aux_loss_coef = 0.0;           // a balancing loss is each rank's own tokens'
  ASSERT_GT(config.num_shared_experts, 0);
  const int64_t micro = 2, seq = 64, local = config.num_experts / p;
  Rng rng(seed_for_current_test() + static_cast<uint64_t>(p));
  const Tensor tokens = random_ids(p * micro * seq, config.vocab_size, rng).view({p * micro, seq});
  const Tensor targets = random_ids(p * micro * seq, config.vocab_size, rng).view({p * micro, seq});
  const float scale = 1.0f / static_cast<float>(p * micro * seq);
  auto rows = [](const Tensor& t, int64_t first, int64_t count) {
    Tensor out = Tensor::empty({count, t.dim(1)}, DType::I32);
    out.copy_from(t.narrow(first, first + count));
    return out.to(Device::CUDA);
  };

  FlatParameters whole(config);
  whole.initialize(31);
  round_to_bf16(whole.flat());
  FlatParameters compute(config, Device::CUDA, DType::BF16), grads(config, Device::CUDA, DType::F32);
  compute.assign_from(whole);
  grads.zero();
  DecoderLM one(config, p * micro, seq, Device::CUDA, DType::BF16, mode);
  const LossSum reference = one.forward_backward(tokens.to(Device::CUDA), targets.to(Device::CUDA), compute, grads, scale);

  std::mutex turn;
  ThreadExchange exchange(p);
  // [ordering][rank]: 0 on the compute stream, 1 GroupExpertDispatch's.
  std::vector<std::vector<LossSum>> losses(2, std::vector<LossSum>(static_cast<size_t>(p)));
  std::vector<std::unique_ptr<FlatParameters>> weights;
  std::vector<std::vector<std::unique_ptr<FlatParameters>>> rank_grads(2);
  for (int r = 0; r < p; ++r) {
    weights.push_back(std::make_unique<FlatParameters>(config, Device::CUDA, DType::BF16));
    weights.back()->assign_from(whole);
    for (auto& ordering : rank_grads) {
      ordering.push_back(std::make_unique<FlatParameters>(config, Device::CUDA, DType::F32));
      ordering.back()->zero();
    }
  }
  const auto errors = run_rank_threads(p, turn, [&](int r) {
    ThreadAllToAll group(turn, exchange, r);
    ComputeStreamDispatch sequential(group);
    GroupExpertDispatch overlapped(group, Device::CUDA);
    for (int ordering = 0; ordering < 2; ++ordering) {
      ExpertDispatch& dispatch = ordering == 0 ? static_cast<ExpertDispatch&>(sequential) : overlapped;
      FlatParameters& g = *rank_grads[static_cast<size_t>(ordering)][static_cast<size_t>(r)];
      testing::LocalExperts w(*weights[static_cast<size_t>(r)], r * local, local), sink(g, r * local, local);
      DecoderLM model(config, micro, seq, Device::CUDA, DType::BF16, mode, &dispatch);
      losses[static_cast<size_t>(ordering)][static_cast<size_t>(r)] =
          model.forward_backward(rows(tokens, r * micro, micro), rows(targets, r * micro, micro), w, sink, scale);
      device_synchronize();  // the exchanges' stream too
    }
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  double sum = 0.0;
  int64_t counted = 0;
  for (int r = 0; r < p; ++r) {
    const LossSum& sequential = losses[0][static_cast<size_t>(r)];
    const LossSum& overlapped = losses[1][static_cast<size_t>(r)];
    EXPECT_EQ(overlapped.tokens, sequential.tokens);
    EXPECT_NEAR(overlapped.sum, sequential.sum, 1e-5 * std::abs(sequential.sum)) << "rank " << r;
    sum += overlapped.sum;
    counted += overlapped.tokens;
    for (size_t s = 0; s < whole.specs().size(); ++s) {
      const Tensor a = to_cpu_f32(rank_grads[1][static_cast<size_t>(r)]->tensors()[s]);
      const Tensor b = to_cpu_f32(rank_grads[0][static_cast<size_t>(r)]->tensors()[s]);
      if (whole.specs()[s].expert_stack)  // the rank's own experts' slice
        EXPECT_LT(relative_l2(a.narrow(r * local, (r + 1) * local), b.narrow(r * local, (r + 1) * local)), 1e-3)
            << whole.specs()[s].name << " on rank " << r;
      else
        EXPECT_LT(relative_l2(a, b), 1e-3) << whole.specs()[s].name << " on rank " << r;
    }
  }
  EXPECT_EQ(counted, reference.tokens);
  EXPECT_NEAR(sum, reference.sum, 2e-3 * std::abs(reference.sum));
}

TEST(GpuExpertParallel, SharedExpertsBesideStreamOrderedExchanges) {
  expect_expert_parallel_ranks_match(2, ActivationCheckpoint::None);
  expect_expert_parallel_ranks_match(2, ActivationCheckpoint::Selective);
  expect_expert_parallel_ranks_match(4, ActivationCheckpoint::Full);
}

}  // namespace
}  // namespace forge::gpu_test
