// NOTE [Expert exchange overlap] in model/moe_feed_forward.cpp on the CPU process group: a
// DeepSeek-shaped model (one shared expert) under expert parallelism 2 and 4, in every
// activation-checkpointing mode, through an expert dispatch that holds every row exchange
// back until its wait, as a communication stream may. Starting an exchange fills the rows it
// is to receive with NaN and copies the rows it is to send; its wait checks that neither was
// written meanwhile and only then exchanges. A layer that read received rows before the wait
// would see the NaNs; one that wrote the rows being sent would be caught. The loss and every
// gradient are bit for bit those of the same ranks with the exchanges done when started (the
// CPU group's own): the shared experts' work between the starts and the waits changes
// nothing, the summation order included.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "cli/config.h"
#include "distributed/expert_dispatch_group.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::LocalExperts;

int64_t sum_of(const std::vector<int64_t>& counts) {
  int64_t s = 0;
  for (int64_t c : counts) s += c;
  return s;
}

// The rows [0, rows) of `t` as bytes.
size_t row_bytes(const Tensor& t, int64_t rows) {
  return t.dim(0) == 0 ? 0 : static_cast<size_t>(rows) * (t.nbytes() / static_cast<size_t>(t.dim(0)));
}

// Every row exchange held back until exchange_wait (NOTE at the top).
class DeferredDispatch final : public ExpertDispatch {
 public:
  explicit DeferredDispatch(ExpertDispatch& inner) : inner_(inner) {}
  ~DeferredDispatch() override = default;

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& send, int64_t per_rank) override {
    return inner_.exchange_counts(send, per_rank);
  }
  void exchange_rows_start(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                           const std::vector<int64_t>& send_counts) override {
    Pending p{output, recv_counts, input, send_counts, {}};
    const size_t sent = row_bytes(input, sum_of(send_counts)), received = row_bytes(output, sum_of(recv_counts));
    p.sent.assign(static_cast<const char*>(input.raw()), static_cast<const char*>(input.raw()) + sent);
    std::memset(output.raw(), 0xff, received);  // NaN in every float dtype
    pending_.push_back(std::move(p));
    ++started_;
  }
  void exchange_wait() override {
    for (const Pending& p : pending_) {
      const size_t received = row_bytes(p.output, sum_of(p.recv));
      FORGE_CHECK(std::memcmp(p.input.raw(), p.sent.data(), p.sent.size()) == 0,
                  "rank {}: rows being sent were written before the exchange's wait", rank());
      const auto* out = static_cast<const unsigned char*>(p.output.raw());
      for (size_t i = 0; i < received; ++i)
        FORGE_CHECK(out[i] == 0xff, "rank {}: rows being received were written before the exchange's wait", rank());
      inner_.exchange_rows(p.output, p.recv, p.input, p.send);
    }
    pending_.clear();
  }

  bool idle() const { return pending_.empty(); }
  int started() const { return started_; }

 private:
  struct Pending {
    Tensor output;
    std::vector<int64_t> recv;
    Tensor input;
    std::vector<int64_t> send;
    std::vector<char> sent;
  };
  ExpertDispatch& inner_;
  std::vector<Pending> pending_;
  int started_ = 0;
};

Tensor rows_of(const Tensor& t, int64_t first, int64_t count) {
  Tensor out = Tensor::empty({count, t.dim(1)}, DType::I32);
  out.copy_from(t.narrow(first, first + count));
  return out;
}

void expect_deferred_exchanges_give_the_same_bits(int ranks, ActivationCheckpoint mode) {
  SCOPED_TRACE(fmt::format("{} ranks, checkpointing {}", ranks, activation_checkpoint_name(mode)));
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny-mla"}}).model;
  ASSERT_GT(m.num_shared_experts, 0);
  const int64_t micro = 2, seq = 8, local = m.num_experts / ranks;
  const Tensor tokens = testing::random_tokens(ranks * micro, seq, m.vocab_size, 21);
  const Tensor targets = testing::random_tokens(ranks * micro, seq, m.vocab_size, 22);
  const float scale = 1.0f / static_cast<float>(ranks * micro * seq);
  FlatParameters params(m);
  params.initialize(7);

  // [run][rank]: 0 the exchanges done when started, 1 held back until their waits.
  std::vector<std::vector<std::unique_ptr<FlatParameters>>> grads(2);
  std::vector<std::vector<LossSum>> losses(2, std::vector<LossSum>(static_cast<size_t>(ranks)));
  std::vector<int> started(static_cast<size_t>(ranks), 0);
  for (auto& run : grads)
    for (int r = 0; r < ranks; ++r) run.push_back(std::make_unique<FlatParameters>(m));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(ranks, [&](int r) {
    auto group = create_process_group(testing::env_of(r, ranks, port), options);
    GroupExpertDispatch direct(*group, Device::CPU);
    DeferredDispatch deferred(direct);
    for (int run = 0; run < 2; ++run) {
      ExpertDispatch& dispatch = run == 0 ? static_cast<ExpertDispatch&>(direct) : deferred;
      FlatParameters& g = *grads[static_cast<size_t>(run)][static_cast<size_t>(r)];
      LocalExperts weights(params, r * local, local), sink(g, r * local, local);
      DecoderLM model(m, micro, seq, Device::CPU, DType::F32, mode, &dispatch);
      losses[static_cast<size_t>(run)][static_cast<size_t>(r)] = model.forward_backward(
          rows_of(tokens, r * micro, micro), rows_of(targets, r * micro, micro), weights, sink, scale);
    }
    FORGE_CHECK(deferred.idle(), "rank {}: an exchange was never waited for", r);
    started[static_cast<size_t>(r)] = deferred.started();
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  // Two MoE blocks, each exchanging twice in its forward and twice in its backward (full
  // checkpointing reruns the forward).
  const int moe_blocks = static_cast<int>(m.num_layers - m.first_dense_layers);
  for (int r = 0; r < ranks; ++r)
    EXPECT_EQ(started[static_cast<size_t>(r)], moe_blocks * (mode == ActivationCheckpoint::Full ? 6 : 4))
        << "rank " << r;
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(losses[0][static_cast<size_t>(r)].sum, losses[1][static_cast<size_t>(r)].sum) << "rank " << r;
    const Tensor& a = grads[0][static_cast<size_t>(r)]->flat();
    const Tensor& b = grads[1][static_cast<size_t>(r)]->flat();
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << "gradients of rank " << r;
  }
}

TEST(ModelExpertExchangeOverlap, SharedExpertsBesideDeferredExchangesGiveTheSameBits) {
  for (ActivationCheckpoint mode : {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_deferred_exchanges_give_the_same_bits(2, mode);
  for (ActivationCheckpoint mode : {ActivationCheckpoint::None, ActivationCheckpoint::Full})
    expect_deferred_exchanges_give_the_same_bits(4, mode);
}

}  // namespace
}  // namespace forge
