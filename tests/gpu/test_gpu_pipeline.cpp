// Pipeline parallelism's CUDA path on one GPU (NOTE [Pipeline parallelism] in
// model/pipeline.h): P pipeline ranks as threads of this process, each running its stages'
// DecoderLMs in bf16 on the same GPU through the 1F1B or interleaved schedule, taking turns
// on it (one thread computes at a time; the turn passes at every exchange, where each rank
// copies its receives from the senders' tensors on the device). The last stage's loss and
// every rank's gradients of its stages' parameters match one GPU's steps over the same
// micro-batches. (NCCL cannot put two ranks on one GPU; its send/recv runs are issue 23's.)
// In FP8 (NOTE [FP8 under context and pipeline parallelism] in train/trainer_fp8.cpp) each
// rank's Fp8Projections over its stages match one GPU's FP8 steps, and after the step end's
// max over the ranks' statistics every rank holds one GPU's delayed scales.
// Under LoRA (NOTE [LoRA under pipeline parallelism] in model/lora.h) each rank's adapters,
// whole, over its stages' bf16 frozen base, with each micro-batch's dropout masks set before
// its forwards and backwards: the sum of the ranks' adapter gradients is one GPU's; so it is
// over a frozen FSDP of the stages and with the stages' frozen base in FP8. A
// Mixture-of-Experts model's pooled and global balancing losses match one GPU's too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "distributed/fsdp.h"
#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "model/parameters.h"
#include "model/pipeline.h"
#include "ops/cross_entropy.h"

namespace forge::gpu_test {
namespace {

// The GPU's turn and one round's posted transfers of every rank.
struct ThreadRound {
  explicit ThreadRound(int size) : barrier(size), posted(static_cast<size_t>(size)) {}
  std::mutex gpu;
  RankBarrier barrier;
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
    round_.barrier.pass(round_.gpu);
    {
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
    round_.barrier.pass(round_.gpu);
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

// A Mixture-of-Experts llama_like with transformers' pooled balancing loss, its coefficient
// large enough that the routers' gradients show it (NOTE [Pooled balancing loss across stages]).
ModelConfig pooled_moe_like() {
  ModelConfig c = llama_like();
  c.name = "gpu-pp-moe-test";
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_ffn_hidden_size = 256;
  c.router_aux_loss_coef = 1.0;
  c.router_aux_loss_type = "pooled";
  return c;
}

// `fsdp_zero` > 0: each rank's weights and gradients are an Fsdp (ZeRO-`fsdp_zero` over a
// one-rank group on the GPU) of its stages: ZeRO-1's gradients reduced once after the
// schedule, ZeRO-2/3's per backward through the rotating slots, ZeRO-3's blocks gathered
// around each use on the communication stream (NOTE [ZeRO-2 and -3 under pipeline
// parallelism] in distributed/fsdp.h).
void expect_stages_match_one_gpu(PipelineScheduleKind kind, int stages, int chunks, int micro_batches,
                                 ActivationCheckpoint mode, int fsdp_zero = 0,
                                 const ModelConfig& config = llama_like()) {
  const bool fsdp = fsdp_zero > 0;
  SCOPED_TRACE(fmt::format("{} on {} ranks x {} chunks, {} micro-batches, checkpointing {}{}",
                           pipeline_schedule_name(kind), stages, chunks, micro_batches,
                           activation_checkpoint_name(mode),
                           fsdp ? fmt::format(", FSDP ZeRO-{} over the stages", fsdp_zero) : ""));
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
      fsdp_options.zero_stage = fsdp_zero;
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

  // The cross-entropy and a pooled balancing loss are the last stage's; the losses that sum
  // over the layers (the global one) each stage's blocks' share (NOTE [Pipeline stages]).
  LossSum last = losses.back();
  EXPECT_EQ(last.tokens, reference.tokens);
  for (int r = 0; r + 1 < stages; ++r) {
    EXPECT_EQ(losses[static_cast<size_t>(r)].tokens, 0) << "rank " << r;
    last.sum += losses[static_cast<size_t>(r)].sum;
  }
  EXPECT_NEAR(last.mean(), reference.mean(), 2e-3 * reference.mean());
  int compared = 0;
  if (fsdp) {
    const std::vector<ParamSpec> specs = parameter_specs(config);
    int64_t elements = 0;
    double worst = 0;
    for (const auto& mine : fsdp_grads)
      for (const auto& [segment, values] : mine) {
        const Tensor whole = to_cpu_f32(grads.find(specs[static_cast<size_t>(segment.spec)].name));
        const Tensor expected = whole.view({whole.numel()}).narrow(segment.param_begin, segment.param_begin + segment.numel);
        const double gap = relative_l2(values.view({segment.numel}), expected);
        EXPECT_LT(gap, 2e-2) << specs[static_cast<size_t>(segment.spec)].name;
        worst = std::max(worst, gap);
        elements += segment.numel;
      }
    EXPECT_EQ(elements, config.total_params());  // every parameter on one rank, whole (one shard rank)
    std::printf("FSDP ZeRO-%d over the stages: loss %.6f vs one GPU's %.6f, worst gradient relative L2 %.3g\n",
                fsdp_zero, last.mean(), reference.mean(), worst);
    return;
  }
  double worst = 0;
  for (int r = 0; r < stages; ++r) {
    const FlatParameters& mine = *rank_grads[static_cast<size_t>(r)];
    for (size_t s = 0; s < mine.specs().size(); ++s) {
      const std::string& name = mine.specs()[s].name;
      const double error = relative_l2(to_cpu_f32(mine.tensors()[s]), to_cpu_f32(grads.find(name)));
      EXPECT_LT(error, 2e-2) << name << " on pipeline rank " << r;
      worst = std::max(worst, error);
      ++compared;
    }
  }
  EXPECT_EQ(compared, static_cast<int>(whole.specs().size()));  // every parameter on one rank
  std::printf("%s, %s on %d ranks x %d chunks: loss %.6f vs %.6f, worst gradient relative L2 %.3e\n",
              config.name.c_str(), pipeline_schedule_name(kind), stages, chunks, last.mean(), reference.mean(), worst);
}

// Two steps of `micro_batches` each, in FP8 with `recipe` (the weight cache and the fused
// producers on, as the trainer runs them), on one GPU and on the stages' rank threads, each
// rank's Fp8Projections over its stages' bf16 weights. Several micro-batches are in flight on
// a rank under 1F1B: the forward statistics are kept per tensor and the scratch serves one
// GEMM at a time, so every quantization is the one GPU's. Between the steps the trainer's
// step end: the ranks' statistics max-reduced (each rank's blocks of other stages'
// projections saw nothing), then end_step, so a delayed second step uses one GPU's scales.
// `fsdp_zero` > 0: each rank's Fp8Projections wrap an Fsdp (ZeRO-`fsdp_zero` over a one-rank
// group) of its stages, as the trainer's (NOTE [FP8 under ZeRO-2 and -3 pipeline ranks] in
// train/trainer_fp8.cpp): under ZeRO-3 the blocks' weights reach the casts from the rotating
// slots, and ZeRO-2/3's gradients are reduced per backward.
void expect_fp8_stages_match_one_gpu(Fp8Recipe recipe, PipelineScheduleKind kind, int stages, int chunks,
                                     int micro_batches, ActivationCheckpoint mode, int fsdp_zero = 0) {
  const bool fsdp = fsdp_zero > 0;
  SCOPED_TRACE(fmt::format("FP8 {} under {} on {} ranks x {} chunks, {} micro-batches, checkpointing {}{}",
                           recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise", pipeline_schedule_name(kind),
                           stages, chunks, micro_batches, activation_checkpoint_name(mode),
                           fsdp ? fmt::format(", FSDP ZeRO-{} over the stages", fsdp_zero) : ""));
  const ModelConfig config = llama_like();
  const int64_t batch = 2, seq = 128;
  Rng rng(seed_for_current_test() + static_cast<uint64_t>(stages * 10 + chunks));
  std::vector<Tensor> tokens, targets;
  for (int m = 0; m < micro_batches; ++m) {
    tokens.push_back(random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA));
    targets.push_back(random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA));
  }
  const float scale = 1.0f / static_cast<float>(micro_batches * batch * seq);
  Fp8Settings settings;
  settings.recipe = recipe;
  settings.weight_cache = true;
  settings.amax_history_length = 4;
  const int64_t projections = fp8_projection_count(config, settings);

  FlatParameters whole(config);
  whole.initialize(23);
  round_to_bf16(whole.flat());
  FlatParameters compute(config, Device::CUDA, DType::BF16), grads(config, Device::CUDA, DType::F32);
  compute.assign_from(whole);
  Fp8Projections one_fp8(config, settings, Device::CUDA, batch * seq);
  one_fp8.set_base(compute, grads);
  DecoderLM one(config, batch, seq, Device::CUDA, DType::BF16, mode);

  ThreadRound round(stages);
  std::vector<std::unique_ptr<ThreadPipeline>> pipelines;
  std::vector<std::unique_ptr<FlatParameters>> rank_weights, rank_grads;
  std::vector<std::unique_ptr<Fp8Projections>> rank_fp8;
  std::vector<std::unique_ptr<PipelineModel>> models;
  std::vector<std::vector<PipelineStage>> rank_stages(static_cast<size_t>(stages));
  std::vector<std::unique_ptr<ProcessGroup>> groups(static_cast<size_t>(stages));
  std::vector<std::unique_ptr<Fsdp>> sharded(static_cast<size_t>(stages));  // built by the rank's thread
  for (int r = 0; r < stages; ++r) {
    std::vector<PipelineStage>& held = rank_stages[static_cast<size_t>(r)];
    for (int v = 0; v < chunks; ++v) held.push_back(pipeline_stage(config, stages, chunks, r, v));
    rank_fp8.push_back(std::make_unique<Fp8Projections>(config, settings, Device::CUDA, batch * seq));
    pipelines.push_back(std::make_unique<ThreadPipeline>(round, r));
    models.push_back(std::make_unique<PipelineModel>(config, batch, seq, Device::CUDA, DType::BF16, mode,
                                                     *pipelines.back(), kind,
                                                     PipelineShape{stages, chunks, micro_batches}));
    rank_weights.push_back(nullptr);
    rank_grads.push_back(nullptr);
    if (fsdp) continue;
    FlatParameters host(config, Device::CPU, DType::F32, {}, held);
    host.initialize(23);
    round_to_bf16(host.flat());
    rank_weights.back() = std::make_unique<FlatParameters>(config, Device::CUDA, DType::BF16, TensorParallelShard{}, held);
    rank_weights.back()->assign_from(host);
    rank_grads.back() = std::make_unique<FlatParameters>(config, Device::CUDA, DType::F32, TensorParallelShard{}, held);
    rank_fp8.back()->set_base(*rank_weights.back(), *rank_grads.back());
  }
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step + 1));
    grads.zero();
    LossSum reference;
    for (int m = 0; m < micro_batches; ++m) {
      const LossSum l = one.forward_backward(tokens[static_cast<size_t>(m)], targets[static_cast<size_t>(m)], one_fp8,
                                             one_fp8, scale);
      reference.sum += l.sum;
      reference.tokens += l.tokens;
    }
    std::vector<LossSum> losses(static_cast<size_t>(stages));
    std::vector<std::vector<std::pair<FsdpSegment, Tensor>>> fsdp_grads(static_cast<size_t>(stages));
    const auto errors = run_rank_threads(stages, round.gpu, [&](int r) {
      const size_t i = static_cast<size_t>(r);
      std::vector<PipelineMicroBatch> micro;
      for (int m = 0; m < micro_batches; ++m)
        micro.push_back({tokens[static_cast<size_t>(m)], targets[static_cast<size_t>(m)], nullptr});
      if (!fsdp) {
        rank_grads[i]->zero();
        losses[i] = models[i]->forward_backward(micro, *rank_fp8[i], *rank_fp8[i], scale);
        return;
      }
      if (!sharded[i]) {  // the first step: the rank's group and its stages' Fsdp, under the FP8 projections
        ProcessGroupOptions options;
        options.device = Device::CUDA;
        groups[i] = create_process_group(LaunchEnv{}, options);
        FsdpOptions fsdp_options;
        fsdp_options.zero_stage = fsdp_zero;
        fsdp_options.pipeline_stages = rank_stages[i];
        sharded[i] = std::make_unique<Fsdp>(config, Device::CUDA, *groups[i], nullptr, fsdp_options);
        sharded[i]->initialize(23);
        rank_fp8[i]->set_base(*sharded[i], *sharded[i]);
      }
      Fsdp& f = *sharded[i];
      f.begin_step();
      losses[i] = models[i]->forward_backward(micro, *rank_fp8[i], *rank_fp8[i], scale);
      f.reduce_gradients();
      f.finish_gradients();
      for (size_t k = 0; k < f.layout().segments().size(); ++k)
        fsdp_grads[i].push_back({f.layout().segments()[k], to_cpu_f32(f.grad_segments()[k])});
    });
    for (const std::string& e : errors) ASSERT_EQ(e, "");
    EXPECT_EQ(losses.back().tokens, reference.tokens);
    EXPECT_NEAR(losses.back().mean(), reference.mean(), 2e-3 * reference.mean());
    if (fsdp) {
      const std::vector<ParamSpec> specs = parameter_specs(config);
      int64_t elements = 0;
      double worst = 0;
      for (const auto& mine : fsdp_grads)
        for (const auto& [segment, values] : mine) {
          const Tensor whole_grad = to_cpu_f32(grads.find(specs[static_cast<size_t>(segment.spec)].name));
          const Tensor expected =
              whole_grad.view({whole_grad.numel()}).narrow(segment.param_begin, segment.param_begin + segment.numel);
          const double gap = relative_l2(values.view({segment.numel}), expected);
          EXPECT_LT(gap, 2e-2) << specs[static_cast<size_t>(segment.spec)].name;
          worst = std::max(worst, gap);
          elements += segment.numel;
        }
      EXPECT_EQ(elements, config.total_params());  // every parameter on one rank, whole (one shard rank)
      std::printf("FP8 over FSDP ZeRO-%d stages: loss %.6f vs one GPU's %.6f, worst gradient relative L2 %.3g\n",
                  fsdp_zero, losses.back().mean(), reference.mean(), worst);
    }
    for (int r = 0; r < stages && !fsdp; ++r) {
      const FlatParameters& mine = *rank_grads[static_cast<size_t>(r)];
      for (size_t s = 0; s < mine.specs().size(); ++s)
        EXPECT_LT(relative_l2(to_cpu_f32(mine.tensors()[s]), to_cpu_f32(grads.find(mine.specs()[s].name))), 2e-2)
            << mine.specs()[s].name << " on pipeline rank " << r;
    }
    // The step end (NOTE [FP8 under context and pipeline parallelism]): every projection's
    // amaxes, the maximum over the ranks, are one GPU's.
    std::vector<float> most = host_values<float>(rank_fp8[0]->statistics());
    for (int r = 1; r < stages; ++r) {
      const std::vector<float> theirs = host_values<float>(rank_fp8[static_cast<size_t>(r)]->statistics());
      for (size_t k = 0; k < most.size(); ++k) most[k] = std::max(most[k], theirs[k]);
    }
    const std::vector<float> want = host_values<float>(one_fp8.statistics());
    for (int64_t p = 0; p < projections; ++p)
      for (int role = 0; role < cpu::kFp8Roles; ++role) {
        const auto offset = static_cast<size_t>(cpu::fp8_seen_offset(p, static_cast<cpu::Fp8Role>(role)));
        EXPECT_GT(want[offset], 0.0f) << "projection " << p << " role " << role;
        EXPECT_NEAR(most[offset], want[offset], 1e-2 * want[offset]) << "projection " << p << " role " << role;
      }
    Tensor reduced = Tensor::empty({static_cast<int64_t>(most.size())}, DType::F32, Device::CPU);
    std::copy(most.begin(), most.end(), reduced.data<float>());
    for (auto& fp8 : rank_fp8) {
      fp8->statistics().copy_from(reduced);
      fp8->end_step(true);
    }
    one_fp8.end_step(true);
  }
  if (recipe != Fp8Recipe::Delayed) return;
  const std::vector<float> want = one_fp8.delayed_state().scales;
  for (int r = 0; r < stages; ++r) {
    const std::vector<float> got = rank_fp8[static_cast<size_t>(r)]->delayed_state().scales;
    EXPECT_EQ(got, rank_fp8[0]->delayed_state().scales) << "pipeline rank " << r;  // one state on every rank
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < want.size(); ++k) EXPECT_NEAR(got[k], want[k], 1e-2 * want[k]) << "scale " << k;
  }
}

// The frozen base of a LoRA rank thread (NOTE [LoRA under pipeline parallelism]): its stages'
// bf16 parameters, a frozen Fsdp of them (ZeRO-1 over a one-rank group: the composition with
// data parallelism), or the flat ones under FP8 projections (tensorwise, frozen; the one-GPU
// reference then runs its base in FP8 too).
enum class LoraStageBase { Flat, FrozenFsdp, Fp8 };

const char* lora_stage_base_name(LoraStageBase b) {
  return b == LoraStageBase::Flat ? "bf16" : b == LoraStageBase::FrozenFsdp ? "frozen FSDP ZeRO-1" : "FP8 tensorwise";
}

// LoRA (rank 8, all-linear, `dropout`) over the bf16 base: one GPU's step against the
// stages' rank threads, each holding every adapter (B off zero, so every gradient is nonzero)
// over its stages' base; after zero_unwritten_gradients the ranks' gradients add up to one GPU's.
void expect_lora_stages_match_one_gpu(PipelineScheduleKind kind, int stages, int chunks, int micro_batches,
                                      ActivationCheckpoint mode, double dropout,
                                      LoraStageBase stage_base = LoraStageBase::Flat) {
  SCOPED_TRACE(fmt::format("LoRA under {} on {} ranks x {} chunks, {} micro-batches, checkpointing {}, dropout {}, "
                           "base {}",
                           pipeline_schedule_name(kind), stages, chunks, micro_batches,
                           activation_checkpoint_name(mode), dropout, lora_stage_base_name(stage_base)));
  Fp8Settings fp8_settings;
  fp8_settings.recipe = Fp8Recipe::Tensorwise;
  fp8_settings.frozen = true;
  fp8_settings.weight_cache = true;
  const bool fp8 = stage_base == LoraStageBase::Fp8;
  const ModelConfig config = llama_like();
  const int64_t batch = 2, seq = 128;
  Rng rng(seed_for_current_test() + static_cast<uint64_t>(stages * 10 + chunks));
  std::vector<Tensor> tokens, targets;
  for (int m = 0; m < micro_batches; ++m) {
    tokens.push_back(random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA));
    targets.push_back(random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA));
  }
  const float scale = 1.0f / static_cast<float>(micro_batches * batch * seq);
  const uint64_t dropout_seed = 41;
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 16;
  lora.dropout = dropout;
  lora.target_modules = "all-linear";
  std::vector<Tensor> b_values;  // B's masters, the same on every rank
  {
    const LoraAdapters shapes(config, lora, Device::CPU, 1);
    for (size_t k = 1; k < shapes.masters().size(); k += 2)
      b_values.push_back(random_f32(shapes.masters()[k].shape(), rng, 0.02));
  }
  auto adapters = [&](ParamSource& base) {
    auto a = std::make_unique<LoraAdapters>(config, lora, Device::CUDA, batch * seq);
    a->initialize(9);
    for (size_t k = 1; k < a->masters().size(); k += 2) a->masters()[k].copy_from(b_values[k / 2].to(Device::CUDA));
    a->refresh_compute();
    a->set_base(base);
    a->discard();
    return a;
  };

  FlatParameters whole(config);
  whole.initialize(23);
  round_to_bf16(whole.flat());
  FlatParameters compute(config, Device::CUDA, DType::BF16);
  compute.assign_from(whole);
  Fp8Projections one_fp8(config, fp8_settings, Device::CUDA, batch * seq);
  one_fp8.set_base(compute);
  auto one = adapters(fp8 ? static_cast<ParamSource&>(one_fp8) : compute);
  DecoderLM decoder(config, batch, seq, Device::CUDA, DType::BF16, mode);
  LossSum reference;
  for (int m = 0; m < micro_batches; ++m) {
    one->set_dropout_step(dropout_seed, static_cast<uint64_t>(m));
    const LossSum l = decoder.forward_backward(tokens[static_cast<size_t>(m)], targets[static_cast<size_t>(m)], *one,
                                               *one, scale);
    reference.sum += l.sum;
    reference.tokens += l.tokens;
  }

  ThreadRound round(stages);
  std::vector<LossSum> losses(static_cast<size_t>(stages));
  std::vector<std::vector<Tensor>> rank_grads(static_cast<size_t>(stages));
  const auto errors = run_rank_threads(stages, round.gpu, [&](int r) {
    const size_t i = static_cast<size_t>(r);
    std::vector<PipelineStage> held;
    for (int v = 0; v < chunks; ++v) held.push_back(pipeline_stage(config, stages, chunks, r, v));
    FlatParameters host(config, Device::CPU, DType::F32, {}, held);
    host.initialize(23);
    round_to_bf16(host.flat());
    FlatParameters weights(config, Device::CUDA, DType::BF16, {}, held);
    weights.assign_from(host);
    std::unique_ptr<ProcessGroup> group;
    std::unique_ptr<Fsdp> frozen;
    Fp8Projections mine_fp8(config, fp8_settings, Device::CUDA, batch * seq);
    mine_fp8.set_base(weights);
    ParamSource* base = fp8 ? static_cast<ParamSource*>(&mine_fp8) : &weights;
    if (stage_base == LoraStageBase::FrozenFsdp) {
      ProcessGroupOptions options;
      options.device = Device::CUDA;
      group = create_process_group(LaunchEnv{}, options);
      FsdpOptions fsdp_options;
      fsdp_options.zero_stage = 1;
      fsdp_options.frozen = true;
      fsdp_options.pipeline_stages = held;
      frozen = std::make_unique<Fsdp>(config, Device::CUDA, *group, nullptr, fsdp_options);
      frozen->initialize(23);  // the same bf16 values as the flat base
      frozen->begin_step();
      base = frozen.get();
    }
    auto mine = adapters(*base);
    ThreadPipeline pipeline(round, r);
    PipelineModel model(config, batch, seq, Device::CUDA, DType::BF16, mode, pipeline, kind,
                        {stages, chunks, micro_batches});
    std::vector<PipelineMicroBatch> micro;
    for (int m = 0; m < micro_batches; ++m)
      micro.push_back({tokens[static_cast<size_t>(m)], targets[static_cast<size_t>(m)], nullptr});
    losses[i] = model.forward_backward(micro, *mine, *mine, scale,
                                       [&](int m) { mine->set_dropout_step(dropout_seed, static_cast<uint64_t>(m)); });
    if (frozen) {
      frozen->reduce_gradients();  // nothing: the adapters are the gradient sink
      frozen->finish_gradients();
    }
    mine->zero_unwritten_gradients();
    for (const Tensor& g : mine->gradients()) rank_grads[i].push_back(to_cpu_f32(g));
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  EXPECT_EQ(losses.back().tokens, reference.tokens);
  EXPECT_NEAR(losses.back().mean(), reference.mean(), 2e-3 * reference.mean());
  double worst = 0;
  for (size_t k = 0; k < one->gradients().size(); ++k) {
    Tensor sum = Tensor::zeros(one->gradients()[k].shape());
    for (const std::vector<Tensor>& of_rank : rank_grads)
      for (int64_t j = 0; j < sum.numel(); ++j) sum.data<float>()[j] += of_rank[k].data<float>()[j];
    const Tensor want = to_cpu_f32(one->gradients()[k]);
    const double error = relative_l2(sum, want);
    worst = std::max(worst, error);
    EXPECT_LT(error, 2e-2) << one->master_names()[k];
    EXPECT_GT(relative_l2(want, Tensor::zeros(want.shape())), 0.0) << one->master_names()[k] << " is zero";
  }
  std::printf("LoRA stages, base %s: loss %.6f vs %.6f, worst adapter gradient relative L2 %.3e\n",
              lora_stage_base_name(stage_base), losses.back().mean(), reference.mean(), worst);
}

TEST(GpuPipeline, LoraThreadRanksMatchOneGpu) {
  expect_lora_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::Selective, 0.0);
  expect_lora_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full, 0.1);
}

// NOTE [LoRA under pipeline parallelism] with data parallelism (the stages' frozen FSDP base)
// and with the frozen base's GEMMs in FP8, stage by stage.
TEST(GpuPipeline, LoraOverFrozenFsdpAndFp8StagesMatchesOneGpu) {
  for (const LoraStageBase b : {LoraStageBase::FrozenFsdp, LoraStageBase::Fp8}) {
    expect_lora_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::Selective, 0.0, b);
    expect_lora_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full, 0.1, b);
  }
}

TEST(GpuPipeline, Fp8ThreadRanksMatchOneGpu) {
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    expect_fp8_stages_match_one_gpu(recipe, PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None);
    expect_fp8_stages_match_one_gpu(recipe, PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full);
  }
}

// NOTE [FP8 under ZeRO-2 and -3 pipeline ranks]: the stages' FP8 projections over FSDP ZeRO-2
// and -3, the ZeRO-3 blocks gathered into the rotating slots (the weight cache keyed by them).
TEST(GpuPipeline, Fp8OverFsdpZero2And3StagesMatchesOneGpu) {
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed})
    for (int zero : {2, 3}) {
      expect_fp8_stages_match_one_gpu(recipe, PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None,
                                      zero);
      expect_fp8_stages_match_one_gpu(recipe, PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full,
                                      zero);
    }
}

TEST(GpuPipeline, FsdpOverTheStagesMatchesOneGpu) {
  expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None, 1);
  expect_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 2, ActivationCheckpoint::Selective, 1);
}

TEST(GpuPipeline, FsdpZero2And3OverTheStagesMatchOneGpu) {
  for (int zero : {2, 3}) {
    expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None, zero);
    expect_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full, zero);
  }
}

// NOTE [Pooled balancing loss across stages]: the statistics cross the stages in device
// buffers with the activations and gradients (the bf16 path, the routers' GEMMs included).
TEST(GpuPipeline, PooledBalancingLossMatchesOneGpu) {
  expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None, 0,
                              pooled_moe_like());
  expect_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full, 0,
                              pooled_moe_like());
}

// NOTE [Global balancing loss across stages]: a chunk's models of its micro-batches in flight
// average the step's counts together, each routing's probability gradient copied to the
// device at its forward (the reference, one DecoderLM, counts the step's micro-batches itself).
TEST(GpuPipeline, GlobalBalancingLossMatchesOneGpu) {
  ModelConfig global = pooled_moe_like();
  global.router_aux_loss_type = "global";
  expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None, 0, global);
  expect_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full, 0, global);
}

TEST(GpuPipeline, ThreadRanksMatchOneGpu) {
  expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None);
  expect_stages_match_one_gpu(PipelineScheduleKind::OneFOneB, 4, 1, 4, ActivationCheckpoint::Selective);
  expect_stages_match_one_gpu(PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full);
}

}  // namespace
}  // namespace forge::gpu_test
