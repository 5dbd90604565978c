// Pipeline parallelism's CUDA path on one GPU (NOTE [Pipeline parallelism] in
// model/pipeline.h): P pipeline ranks as threads of this process, each running its stages'
// DecoderLMs in bf16 on the same GPU through the 1F1B or interleaved schedule, taking turns
// on it (one thread computes at a time; the turn passes at every exchange, where each rank
// copies its receives from the senders' tensors on the device). The last stage's loss and
// every rank's gradients of its stages' parameters match one GPU's steps over the same
// micro-batches. (NCCL cannot put two ranks on one GPU; its send/recv runs are issue 23's.)
#include <gtest/gtest.h>

#include <barrier>
#include <mutex>

#include "distributed/fsdp.h"
#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "model/pipeline.h"
#include "ops/cross_entropy.h"

namespace forge::gpu_test {
namespace {

// The GPU's turn and one round's posted transfers of every rank.
struct ThreadRound {
  explicit ThreadRound(int size) : barrier(size), posted(static_cast<size_t>(size)) {}
  std::mutex gpu;
  std::barrier<> barrier;
  std::vector<const std::vector<PipelineParallel::Transfer>*> posted;
};

// A rank's k-th receive from rank q takes q's k-th send to it.
class ThreadPipeline final : public PipelineParallel {
 public:
  ThreadPipeline(ThreadRound& round, int rank) : round_(round), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(round_.posted.size()); }
  void exchange(const std::vector<Transfer>& transfers) override {
    device_synchronize();
    round_.posted[static_cast<size_t>(rank_)] = &transfers;
    round_.gpu.unlock();
    round_.barrier.arrive_and_wait();
    {
      std::lock_guard<std::mutex> lock(round_.gpu);
      std::vector<size_t> taken(round_.posted.size(), 0);  // sends already matched, per peer
      for (const Transfer& mine : transfers) {
        if (mine.send) continue;
        const auto& theirs = *round_.posted[static_cast<size_t>(mine.peer)];
        size_t seen = 0;
        for (const Transfer& t : theirs)
          if (t.send && t.peer == rank_ && seen++ == taken[static_cast<size_t>(mine.peer)]) {
            FORGE_CHECK(t.tensor.nbytes() == mine.tensor.nbytes(), "transfer of {} bytes into {}", t.tensor.nbytes(),
                        mine.tensor.nbytes());
            copy_bytes(mine.tensor.raw(), Device::CUDA, t.tensor.raw(), Device::CUDA, t.tensor.nbytes());
            break;
          }
        ++taken[static_cast<size_t>(mine.peer)];
      }
      device_synchronize();
    }
    round_.barrier.arrive_and_wait();
    round_.gpu.lock();
  }

 private:
  ThreadRound& round_;
  int rank_;
};

ModelConfig llama_like() {
  ModelConfig c;
  c.name = "gpu-pp-test";
  c.vocab_size = 1024;
  c.hidden_size = 256;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 512;
  c.max_seq_len = 256;
  c.rope_theta = 500000;
  c.init_std = 0.05;
  return c;
}

// `fsdp`: each rank's weights and gradients are an Fsdp (ZeRO-1 over a one-rank group on
// the GPU) of its stages, its gradients reduced once after the schedule.
void expect_stages_match_one_gpu(PipelineScheduleKind kind, int stages, int chunks, int micro_batches,
                                 ActivationCheckpoint mode, bool fsdp = false) {
  SCOPED_TRACE(fmt::format("{} on {} ranks x {} chunks, {} micro-batches, checkpointing {}{}",
                           pipeline_schedule_name(kind), stages, chunks, micro_batches,
                           activation_checkpoint_name(mode), fsdp ? ", FSDP ZeRO-1 over the stages" : ""));
  const ModelConfig config = llama_like();
  const int64_t batch = 2, seq = 128;
  Rng rng(seed_for_current_test() + static_cast<uint64_t>(stages * 10 + chunks));
  std::vector<Tensor> tokens, targets;
  for (int m = 0; m < micro_batches; ++m) {
    tokens.push_back(random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA));
    targets.push_back(random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA));
  }
  const float scale = 1.0f / static_cast<float>(micro_batches * batch * seq);

  FlatParameters whole(config);
  whole.initialize(23);
  round_to_bf16(whole.flat());
  FlatParameters compute(config, Device::CUDA, DType::BF16), grads(config, Device::CUDA, DType::F32);
  compute.assign_from(whole);
  grads.zero();
  DecoderLM one(config, batch, seq, Device::CUDA, DType::BF16, mode);
  LossSum reference;
  for (int m = 0; m < micro_batches; ++m) {
    const LossSum l = one.forward_backward(tokens[static_cast<size_t>(m)], targets[static_cast<size_t>(m)], compute,
                                           grads, scale);
    reference.sum += l.sum;
    reference.tokens += l.tokens;
  }

  ThreadRound round(stages);
  std::vector<LossSum> losses(static_cast<size_t>(stages));
  std::vector<std::vector<PipelineStage>> held(static_cast<size_t>(stages));
  std::vector<std::unique_ptr<FlatParameters>> rank_grads(static_cast<size_t>(stages));
  std::vector<std::vector<std::pair<FsdpSegment, Tensor>>> fsdp_grads(static_cast<size_t>(stages));
  for (int r = 0; r < stages; ++r)
    for (int v = 0; v < chunks; ++v) held[static_cast<size_t>(r)].push_back(pipeline_stage(config, stages, chunks, r, v));
  const auto errors = run_rank_threads(stages, round.gpu, [&](int r) {
    const size_t i = static_cast<size_t>(r);
    ThreadPipeline pipeline(round, r);
    std::vector<PipelineMicroBatch> micro;
    for (int m = 0; m < micro_batches; ++m)
      micro.push_back({tokens[static_cast<size_t>(m)], targets[static_cast<size_t>(m)], nullptr});
    PipelineModel model(config, batch, seq, Device::CUDA, DType::BF16, mode, pipeline, kind,
                        {stages, chunks, micro_batches});
    if (fsdp) {
      ProcessGroupOptions options;
      options.device = Device::CUDA;
      auto group = create_process_group(LaunchEnv{}, options);
      FsdpOptions fsdp_options;
      fsdp_options.zero_stage = 1;
      fsdp_options.pipeline_stages = held[i];
      Fsdp sharded(config, Device::CUDA, *group, nullptr, fsdp_options);
      sharded.initialize(23);
      sharded.begin_step();
      losses[i] = model.forward_backward(micro, sharded, sharded, scale);
      sharded.reduce_gradients();
      sharded.finish_gradients();
      for (size_t k = 0; k < sharded.layout().segments().size(); ++k)
        fsdp_grads[i].push_back({sharded.layout().segments()[k], to_cpu_f32(sharded.grad_segments()[k])});
      return;
    }
    FlatParameters host(config, Device::CPU, DType::F32, {}, held[i]);
    host.initialize(23);
    round_to_bf16(host.flat());
    FlatParameters weights(config, Device::CUDA, DType::BF16, {}, held[i]);
    weights.assign_from(host);
    rank_grads[i] = std::make_unique<FlatParameters>(config, Device::CUDA, DType::F32, TensorParallelShard{}, held[i]);
    rank_grads[i]->zero();
    losses[i] = model.forward_backward(micro, weights, *rank_grads[i], scale);
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  const LossSum& last = losses.back();
  EXPECT_EQ(last.tokens, reference.tokens);
  EXPECT_NEAR(last.mean(), reference.mean(), 2e-3 * reference.mean());
  for (int r = 0; r + 1 < stages; ++r) EXPECT_EQ(losses[static_cast<size_t>(r)].tokens, 0) << "rank " << r;
  int compared = 0;
  if (fsdp) {
    const std::vector<ParamSpec> specs = parameter_specs(config);
    int64_t elements = 0;
    for (const auto& mine : fsdp_grads)
      for (const auto& [segment, values] : mine) {
        const Tensor whole = to_cpu_f32(grads.find(specs[static_cast<size_t>(segment.spec)].name));
        const Tensor expected = whole.view({whole.numel()}).narrow(segment.param_begin, segment.param_begin + segment.numel);
        EXPECT_LT(relative_l2(values.view({segment.numel}), expected), 2e-2) << specs[static_cast<size_t>(segment.spec)].name;
        elements += segment.numel;
      }
    EXPECT_EQ(elements, config.total_params());  // every parameter on one rank, whole (one shard rank)
    return;
  }
  for (int r = 0; r < stages; ++r) {
    const FlatParameters& mine = *rank_grads[static_cast<size_t>(r)];
    for (size_t s = 0; s < mine.specs().size(); ++s) {
      const std::string& name = mine.specs()[s].name;
      EXPECT_LT(relative_l2(to_cpu_f32(mine.tensors()[s]), to_cpu_f32(grads.find(name))), 2e-2)
          << name << " on pipeline rank " << r;
      ++compared;
    }
  }
  EXPECT_EQ(compared, static_cast<int>(whole.specs().size()));  // every parameter on one rank
}

TEST(GpuPipeline, FsdpOverTheStagesMatchesOneGpu) {
  expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None, true);
  expect_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 2, ActivationCheckpoint::Selective, true);
}

TEST(GpuPipeline, ThreadRanksMatchOneGpu) {
  expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None);
  expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 4, 1, 4, ActivationCheckpoint::Selective);
  expect_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full);
}

}  // namespace
}  // namespace forge::gpu_test
