// FSDP on the GPU with one rank (NCCL over a communicator of one): every ZeRO stage and
// reduce dtype trains three steps with accumulation like the single-device CUDA path does,
// which exercises the communication stream, the events that order it against the compute
// stream, ZeRO-3's rotating gather buffers and prefetch, and the accumulation of reduced
// chunks on the GPU; and LoRA over a frozen base (NOTE [Frozen FSDP base]: bf16 chunks
// gathered by copies on the communication stream) computes what it computes over the whole
// bf16 base; FP8 over a ZeRO-3 Fsdp (NOTE [FP8 under data parallelism]) computes the flat
// weights' losses, and its weight cache, whose projections see their weights in rotating
// gather buffers, changes no bit; and LoRA over the frozen base with its GEMMs in FP8 (NOTE
// [FP8 frozen base]) computes what it computes over the whole bf16 base. Multi-GPU parity runs through scripts/gpu-fsdp (its lora
// section for LoRA).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <span>

#include "distributed/fsdp.h"
#include "distributed/launch_env.h"
#include "gpu_testing.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "optim/optimizer.h"

namespace forge::gpu_test {
namespace {

ModelConfig fsdp_model() {
  ModelConfig c;
  c.name = "gpu-fsdp-test";
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.num_layers = 4;  // more blocks than ZeRO-3's three gather buffers
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 512;
  c.max_seq_len = 128;
  c.init_std = 0.05;
  return c;
}

constexpr int kSteps = 3, kAccum = 2, kBatch = 2, kSeq = 64;

struct Curve {
  std::vector<double> losses;
  Tensor weights;  // fp32, parameter_specs order, on the CPU
};

Tensor ids(uint64_t seed, int64_t vocab) {
  Rng rng(seed);
  return random_ids(kBatch * kSeq, vocab, rng).view({kBatch, kSeq});
}

Curve single_device(const ModelConfig& c) {
  FlatParameters master(c, Device::CUDA, DType::F32), compute(c, Device::CUDA, DType::BF16),
      grads(c, Device::CUDA, DType::F32);
  master.initialize(5);
  compute.assign_from(master);
  std::vector<bool> decay;
  for (const auto& s : master.specs()) decay.push_back(s.weight_decay);
  AdamW adamw(OptimizerConfig{}, master.tensors(), decay);
  DecoderLM model(c, kBatch, kSeq, Device::CUDA, DType::BF16);
  Curve curve;
  for (int step = 0; step < kSteps; ++step) {
    grads.zero();
    LossSum loss;
    for (int a = 0; a < kAccum; ++a) {
      LossSum l = model.forward_backward(ids(10 * step + a, c.vocab_size).to(Device::CUDA),
                                         ids(1000 + 10 * step + a, c.vocab_size).to(Device::CUDA), compute, grads,
                                         1.0f / (kAccum * kBatch * kSeq));
      loss.sum += l.sum;
      loss.tokens += l.tokens;
    }
    const double norm = global_grad_norm({grads.flat()});
    adamw.step(grads.tensors(), 1e-3, clip_coefficient(norm, 1.0), compute.tensors());
    curve.losses.push_back(loss.mean());
  }
  curve.weights = master.flat().to(Device::CPU);
  return curve;
}

Curve fsdp(const ModelConfig& c, int stage, DType reduce) {
  ProcessGroupOptions options;
  options.device = Device::CUDA;
  auto group = create_process_group(LaunchEnv{}, options);
  FsdpOptions fsdp_options;
  fsdp_options.zero_stage = stage;
  fsdp_options.reduce_dtype = reduce;
  Fsdp sharded(c, Device::CUDA, *group, nullptr, fsdp_options);
  sharded.initialize(5);
  std::vector<bool> decay;
  for (const FsdpSegment& s : sharded.layout().segments()) decay.push_back(s.weight_decay);
  AdamW adamw(OptimizerConfig{}, sharded.master_segments(), decay);
  DecoderLM model(c, kBatch, kSeq, Device::CUDA, DType::BF16);
  Curve curve;
  for (int step = 0; step < kSteps; ++step) {
    sharded.begin_step();
    LossSum loss;
    for (int a = 0; a < kAccum; ++a) {
      sharded.begin_micro_batch(a == kAccum - 1);
      LossSum l = model.forward_backward(ids(10 * step + a, c.vocab_size).to(Device::CUDA),
                                         ids(1000 + 10 * step + a, c.vocab_size).to(Device::CUDA), sharded, sharded,
                                         1.0f / (kAccum * kBatch * kSeq));
      sharded.end_micro_batch();
      loss.sum += l.sum;
      loss.tokens += l.tokens;
    }
    sharded.finish_gradients();
    const double norm = std::sqrt(sharded.global_grad_sum_of_squares());
    adamw.step(sharded.grad_segments(), 1e-3, clip_coefficient(norm, 1.0), sharded.compute_segments());
    sharded.refresh_compute_weights(true);
    EXPECT_GE(sharded.take_exposed_comm_seconds(), 0.0);
    curve.losses.push_back(loss.mean());
  }
  curve.weights = Tensor::zeros({c.total_params()});
  for (size_t i = 0; i < sharded.layout().segments().size(); ++i) {
    const FsdpSegment& s = sharded.layout().segments()[i];
    curve.weights.narrow(s.flat_offset, s.flat_offset + s.numel).copy_from(sharded.master_segments()[i].to(Device::CPU));
  }
  return curve;
}

TEST(GpuFsdp, OneRankTrainsLikeTheSingleDevicePath) {
  if (read_launch_env().world_size != 1) GTEST_SKIP() << "a one-rank test";
  const ModelConfig c = fsdp_model();
  const Curve reference = single_device(c);
  // The weights' movement over the steps: differences are measured against it, since
  // Adam turns any change in a near-zero gradient (the attention backward's dQ is not
  // even deterministic) into a step of up to the lr either way.
  FlatParameters init(c);
  init.initialize(5);
  auto update_fraction = [&](const Tensor& got) {
    double diff = 0, update = 0;
    for (int64_t i = 0; i < got.numel(); ++i) {
      const double d = got.data<float>()[i] - reference.weights.data<float>()[i];
      const double u = reference.weights.data<float>()[i] - init.flat().data<float>()[i];
      diff += d * d;
      update += u * u;
    }
    return std::sqrt(diff / update);
  };
  for (int stage : {1, 2, 3}) {
    for (DType reduce : {DType::F32, DType::BF16}) {
      const Curve got = fsdp(c, stage, reduce);
      const double tolerance = reduce == DType::F32 ? 1e-3 : 3e-3;
      for (int i = 0; i < kSteps; ++i)
        EXPECT_NEAR(got.losses[i], reference.losses[i], tolerance * reference.losses[i])
            << "ZeRO-" << stage << " " << dtype_name(reduce) << " step " << i;
      EXPECT_LT(update_fraction(got.weights), reduce == DType::F32 ? 0.05 : 0.1)
          << "ZeRO-" << stage << " " << dtype_name(reduce);
    }
  }
}

// Three micro-batches of LoRA gradients (all-linear, rank 8, dropout) over a one-rank frozen
// Fsdp in every stage against the same over a bf16 FlatParameters base: the base values
// are the same bf16 numbers and the gathers copy them, so only the attention backward's
// nondeterminism can tell them apart.
TEST(GpuFsdp, LoraOverAFrozenBaseMatchesTheWholeBase) {
  if (read_launch_env().world_size != 1) GTEST_SKIP() << "a one-rank test";
  const ModelConfig c = fsdp_model();
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 16.0;
  lora.dropout = 0.1;
  lora.target_modules = "all-linear";
  auto run = [&](ParamSource& base) {
    LoraAdapters adapters(c, lora, Device::CUDA, kBatch * kSeq);
    adapters.initialize(3);
    Rng rng(17);
    for (size_t k = 0; k < adapters.targets().size(); ++k)  // B nonzero, so A has gradients
      for (size_t p = 0; p < adapters.targets()[k].parts.size(); ++p)
        adapters.set_part_matrix(k, p, 'b', random_f32(adapters.part_matrix(k, p, 'b').shape(), rng, 0.02));
    adapters.set_base(base);
    DecoderLM model(c, kBatch, kSeq, Device::CUDA, DType::BF16, ActivationCheckpoint::Full);
    std::vector<double> losses;
    adapters.discard();
    for (int a = 0; a < 3; ++a) {
      adapters.set_dropout_step(9, static_cast<uint64_t>(a));
      losses.push_back(model.forward_backward(ids(10 + a, c.vocab_size).to(Device::CUDA),
                                              ids(1010 + a, c.vocab_size).to(Device::CUDA), adapters, adapters,
                                              1.0f / (3 * kBatch * kSeq)).sum);
    }
    return std::make_pair(losses, adapters.gradient_flat().to(Device::CPU));
  };
  FlatParameters base(c, Device::CUDA, DType::BF16);
  base.initialize(5);
  const auto reference = run(base);
  ProcessGroupOptions options;
  options.device = Device::CUDA;
  auto group = create_process_group(LaunchEnv{}, options);
  for (int stage : {1, 3}) {
    FsdpOptions fsdp_options;
    fsdp_options.zero_stage = stage;
    fsdp_options.frozen = true;
    Fsdp frozen(c, Device::CUDA, *group, nullptr, fsdp_options);
    frozen.initialize(5);
    EXPECT_EQ(frozen.memory().master_weights, 0);
    const auto got = run(frozen);
    for (size_t i = 0; i < reference.first.size(); ++i)
      EXPECT_NEAR(got.first[i], reference.first[i], 1e-5 * std::abs(reference.first[i])) << "ZeRO-" << stage;
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < got.second.numel(); ++i) {
      const double d = got.second.data<float>()[i] - reference.second.data<float>()[i];
      diff += d * d;
      norm += static_cast<double>(reference.second.data<float>()[i]) * reference.second.data<float>()[i];
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-3) << "ZeRO-" << stage;
  }
}

// NOTE [FP8 frozen base] over FSDP's frozen base: LoRA (all-linear, rank 8) with the base's
// GEMMs in FP8, two steps of three micro-batches over a one-rank frozen ZeRO-3 Fsdp (four
// blocks through three gather buffers) against the same over the flat bf16 base: the same
// bf16 weights cast to the same codes, so the losses agree (the forward is deterministic)
// and the adapters' gradients within the attention backward's nondeterminism; the weight
// cache, filled once for the run while the gathers rotate the weights' addresses, changes no
// loss. With `delayed` the second step quantizes with the scales the first one set. NOTE [FP8
// all-gather of a frozen base]: the base gathered as E4M3 codes (ZeRO-3 and ZeRO-1, the bf16
// chunk copied to fp32 before the casts) agrees the same way.
TEST(GpuFsdp, LoraFp8OverAFrozenBaseMatchesTheWholeBase) {
  if (read_launch_env().world_size != 1) GTEST_SKIP() << "a one-rank test";
  const ModelConfig c = fsdp_model();
  LoraConfig lora;
  lora.rank = 8;
  lora.alpha = 16.0;
  lora.target_modules = "all-linear";
  auto run = [&](ParamSource& base, const Fp8Settings& settings, Fsdp* fp8_gather = nullptr) {
    Fp8Projections fp8(c, settings, Device::CUDA, kBatch * kSeq);
    fp8.set_base(base);
    if (fp8_gather) fp8_gather->set_fp8_projections(fp8);
    LoraAdapters adapters(c, lora, Device::CUDA, kBatch * kSeq);
    adapters.initialize(3);
    Rng rng(17);
    for (size_t k = 0; k < adapters.targets().size(); ++k)  // B nonzero, so A has gradients
      for (size_t p = 0; p < adapters.targets()[k].parts.size(); ++p)
        adapters.set_part_matrix(k, p, 'b', random_f32(adapters.part_matrix(k, p, 'b').shape(), rng, 0.02));
    adapters.set_base(fp8);
    DecoderLM model(c, kBatch, kSeq, Device::CUDA, DType::BF16, ActivationCheckpoint::Selective);
    std::vector<double> losses;
    for (int step = 0; step < 2; ++step) {
      adapters.discard();
      for (int a = 0; a < 3; ++a)
        losses.push_back(model.forward_backward(ids(10 * step + a, c.vocab_size).to(Device::CUDA),
                                                ids(1010 + 10 * step + a, c.vocab_size).to(Device::CUDA), adapters,
                                                adapters, 1.0f / (3 * kBatch * kSeq))
                             .sum);
      EXPECT_EQ(fp8.first_nonfinite_amax().slot, -1);
      fp8.end_step(true);
    }
    return std::make_pair(losses, adapters.gradient_flat().to(Device::CPU));
  };
  FlatParameters base(c, Device::CUDA, DType::BF16);
  base.initialize(5);
  ProcessGroupOptions options;
  options.device = Device::CUDA;
  auto group = create_process_group(LaunchEnv{}, options);
  FsdpOptions fsdp_options;
  fsdp_options.zero_stage = 3;
  fsdp_options.frozen = true;
  Fsdp frozen(c, Device::CUDA, *group, nullptr, fsdp_options);
  frozen.initialize(5);
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    SCOPED_TRACE(recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise");
    Fp8Settings settings;
    settings.recipe = recipe;
    settings.frozen = true;
    const auto reference = run(base, settings);
    const auto uncached = run(frozen, settings);
    settings.weight_cache = true;
    const auto cached = run(frozen, settings);
    for (size_t i = 0; i < reference.first.size(); ++i) {
      EXPECT_NEAR(uncached.first[i], reference.first[i], 1e-5 * std::abs(reference.first[i])) << "micro-batch " << i;
      EXPECT_NEAR(cached.first[i], reference.first[i], 1e-5 * std::abs(reference.first[i])) << "micro-batch " << i;
    }
    EXPECT_NE(reference.first[0], reference.first[3]);  // the steps' batches differ
    for (const auto* got : {&uncached, &cached}) {
      double diff = 0, norm = 0;
      for (int64_t i = 0; i < got->second.numel(); ++i) {
        const double d = got->second.data<float>()[i] - reference.second.data<float>()[i];
        diff += d * d;
        norm += static_cast<double>(reference.second.data<float>()[i]) * reference.second.data<float>()[i];
      }
      EXPECT_LT(std::sqrt(diff / norm), 2e-2) << (got == &cached ? "cached" : "uncached");
    }
    settings.weight_cache = false;
    for (const int stage : {3, 1}) {
      SCOPED_TRACE(::testing::Message() << "FP8 all-gather, ZeRO-" << stage);
      FsdpOptions gather_options = fsdp_options;
      gather_options.zero_stage = stage;
      gather_options.fp8_all_gather = true;
      Fsdp gathered(c, Device::CUDA, *group, nullptr, gather_options);
      gathered.initialize(5);
      const auto got = run(gathered, settings, &gathered);
      for (size_t i = 0; i < reference.first.size(); ++i)
        EXPECT_NEAR(got.first[i], reference.first[i], 1e-5 * std::abs(reference.first[i])) << "micro-batch " << i;
      double diff = 0, norm = 0;
      for (int64_t i = 0; i < got.second.numel(); ++i) {
        const double d = got.second.data<float>()[i] - reference.second.data<float>()[i];
        diff += d * d;
        norm += static_cast<double>(reference.second.data<float>()[i]) * reference.second.data<float>()[i];
      }
      EXPECT_LT(std::sqrt(diff / norm), 2e-2);
    }
  }
}

// NOTE [FP8 under data parallelism], NOTE [FP8 weight cache]: FP8 training steps over a
// one-rank ZeRO-3 Fsdp, whose four blocks rotate through three gather buffers, so a
// projection meets its weights at another buffer's address than other projections did
// before it. Between steps the optimizer's turn is played by loading every weight scaled
// (the weights move, the cache's codes go stale). With the cache every loss and gradient
// chunk is bitwise the uncached run's, and the losses and delayed scales are those of the
// flat bf16 weights on one device (the same bf16 values, the same casts): a projection that
// reused another layer's codes, or codes of an earlier step, would change them.
struct Fp8FsdpTrace {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;  // per step: the gradient chunk, segment by segment
  std::vector<float> scales;
};

// zero_stage and fp8_gather: the sharded run's (NOTE [FP8 all-gather]).
Fp8FsdpTrace fp8_steps(const ModelConfig& c, const Fp8Settings& settings, bool sharded_run, int zero_stage = 3,
                       bool fp8_gather = false) {
  FlatParameters init(c);
  init.initialize(5);
  auto scaled = [&](int step, int64_t offset, std::span<float> out) {
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = init.flat().data<float>()[offset + static_cast<int64_t>(i)] * (1.0f + 0.01f * static_cast<float>(step));
  };
  std::unique_ptr<ProcessGroup> group;
  std::unique_ptr<Fsdp> sharded;
  if (sharded_run) {
    ProcessGroupOptions options;
    options.device = Device::CUDA;
    group = create_process_group(LaunchEnv{}, options);
    FsdpOptions fsdp_options;
    fsdp_options.zero_stage = zero_stage;
    fsdp_options.fp8_all_gather = fp8_gather;
    fsdp_options.fp8_routed_experts = settings.routed_experts;  // NOTE [FP8 all-gather pieces]
    fsdp_options.fp8_output_head = settings.output_head;        // NOTE [FP8 all-gather of the head]
    sharded = std::make_unique<Fsdp>(c, Device::CUDA, *group, nullptr, fsdp_options);
  }
  FlatParameters flat(c, Device::CUDA, DType::BF16), flat_grads(c, Device::CUDA, DType::F32);
  Fp8Projections fp8(c, settings, Device::CUDA, kBatch * kSeq);
  if (sharded) {
    fp8.set_base(*sharded, *sharded);
    if (fp8_gather) sharded->set_fp8_projections(fp8);
  } else {
    fp8.set_base(flat, flat_grads);
  }
  DecoderLM model(c, kBatch, kSeq, Device::CUDA, DType::BF16, ActivationCheckpoint::Full);
  Fp8FsdpTrace trace;
  for (int step = 0; step < kSteps; ++step) {
    if (sharded) {
      sharded->load_master([&](int64_t offset, std::span<float> out) { scaled(step, offset, out); });
      sharded->begin_step();
    } else {
      FlatParameters host(c);
      scaled(step, 0, std::span<float>(host.flat().data<float>(), static_cast<size_t>(host.flat().numel())));
      flat.assign_from(host);
      flat_grads.discard();
    }
    for (int a = 0; a < kAccum; ++a) {
      if (sharded) sharded->begin_micro_batch(a == kAccum - 1);
      trace.losses.push_back(model
                                 .forward_backward(ids(10 * step + a, c.vocab_size).to(Device::CUDA),
                                                   ids(1000 + 10 * step + a, c.vocab_size).to(Device::CUDA), fp8, fp8,
                                                   1.0f / (kAccum * kBatch * kSeq))
                                 .mean());
      if (sharded) sharded->end_micro_batch();
    }
    if (sharded) {
      sharded->finish_gradients();
      std::vector<float> chunk;
      for (const Tensor& segment : sharded->grad_segments()) {
        const std::vector<float> values = host_values<float>(segment);
        chunk.insert(chunk.end(), values.begin(), values.end());
      }
      trace.grads.push_back(std::move(chunk));
    }
    fp8.end_step(true);
  }
  if (settings.recipe == Fp8Recipe::Delayed) trace.scales = fp8.delayed_state().scales;
  return trace;
}

TEST(GpuFsdp, Fp8WeightCacheUnderZero3) {
  if (read_launch_env().world_size != 1) GTEST_SKIP() << "a one-rank test";
  ModelConfig c = small_model("gpu-fsdp-fp8");
  c.num_layers = 4;  // more blocks than ZeRO-3's three gather buffers
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    SCOPED_TRACE(recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise");
    Fp8Settings settings;
    settings.recipe = recipe;
    settings.weight_cache = true;
    const Fp8FsdpTrace flat = fp8_steps(c, settings, false);
    const Fp8FsdpTrace cached = fp8_steps(c, settings, true);
    settings.weight_cache = false;
    const Fp8FsdpTrace uncached = fp8_steps(c, settings, true);
    EXPECT_EQ(cached.losses, uncached.losses);
    ASSERT_EQ(cached.grads.size(), uncached.grads.size());
    for (size_t i = 0; i < cached.grads.size(); ++i) EXPECT_TRUE(cached.grads[i] == uncached.grads[i]) << "step " << i;
    EXPECT_EQ(cached.losses, flat.losses);
    EXPECT_EQ(cached.scales, uncached.scales);
    EXPECT_EQ(cached.scales, flat.scales);
  }
}

// NOTE [FP8 all-gather]: the blocks' projections gathered as E4M3 codes, cast from the master
// chunk with the whole weight's scale, give bitwise the losses, gradient chunks and delayed
// scales of the bf16 gather whose weights each projection casts itself: the same codes and
// scales, through the pre-quantized path of the FP8 linear ops (the forward's codes, the
// input gradient's byte transpose). ZeRO-3 (four blocks through three slots) and ZeRO-1
// (one slot per block, gathered again after each step); and with the FP8 head, whose weight
// is gathered as codes too (NOTE [FP8 all-gather of the head]).
TEST(GpuFsdp, Fp8AllGatherIsTheBf16Gather) {
  if (read_launch_env().world_size != 1) GTEST_SKIP() << "a one-rank test";
  ModelConfig c = small_model("gpu-fsdp-fp8-gather");
  c.num_layers = 4;
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    for (const bool head : {false, true}) {
      for (const int stage : {3, 1}) {
        SCOPED_TRACE(testing::Message() << (recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise") << " ZeRO-"
                                        << stage << (head ? ", FP8 head" : ""));
        Fp8Settings settings;
        settings.recipe = recipe;
        settings.output_head = head;
        const Fp8FsdpTrace bf16 = fp8_steps(c, settings, true, stage, false);
        const Fp8FsdpTrace gathered = fp8_steps(c, settings, true, stage, true);
        EXPECT_EQ(gathered.losses, bf16.losses);
        ASSERT_EQ(gathered.grads.size(), bf16.grads.size());
        for (size_t i = 0; i < gathered.grads.size(); ++i)
          EXPECT_TRUE(gathered.grads[i] == bf16.grads[i]) << "step " << i;
        EXPECT_EQ(gathered.scales, bf16.scales);
      }
    }
  }
}

// NOTE [FP8 all-gather pieces] (distributed/fsdp_fp8_pieces.h): on a Mixture-of-Experts model
// (Mixtral-shaped) and a DeepSeek-V3-shaped one (MLA with q_lora_rank, a dense first block,
// sigmoid-routed experts and shared experts), the routed experts gathered as E4M3 codes with
// a scale per expert and MLA's kv_a with one per row view, the router in bf16, give bitwise
// the losses, gradient chunks and delayed scales of the bf16 gather (each expert's, each row
// view's GEMMs casting the bf16 weights themselves). ZeRO-3 (four blocks through three
// slots) and ZeRO-1.
TEST(GpuFsdp, Fp8AllGatherOfExpertsAndLatentAttentionIsTheBf16Gather) {
  if (read_launch_env().world_size != 1) GTEST_SKIP() << "a one-rank test";
  ModelConfig moe = small_moe();
  moe.name = "gpu-fsdp-fp8-gather-moe";
  moe.num_layers = 4;
  ModelConfig deepseek = small_deepseek(true);
  deepseek.name = "gpu-fsdp-fp8-gather-deepseek-v3";
  deepseek.rope_scaling = RopeScaling{};
  deepseek.num_layers = 4;
  for (const ModelConfig& c : {moe, deepseek}) {
    for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
      for (const int stage : {3, 1}) {
        SCOPED_TRACE(testing::Message() << c.name << " " << (recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise")
                                        << " ZeRO-" << stage);
        Fp8Settings settings;
        settings.recipe = recipe;
        const Fp8FsdpTrace bf16 = fp8_steps(c, settings, true, stage, false);
        const Fp8FsdpTrace gathered = fp8_steps(c, settings, true, stage, true);
        ASSERT_EQ(gathered.losses.size(), bf16.losses.size());
        for (double loss : gathered.losses) EXPECT_TRUE(std::isfinite(loss));
        EXPECT_EQ(gathered.losses, bf16.losses);
        ASSERT_EQ(gathered.grads.size(), bf16.grads.size());
        for (size_t i = 0; i < gathered.grads.size(); ++i)
          EXPECT_TRUE(gathered.grads[i] == bf16.grads[i]) << "step " << i;
        EXPECT_EQ(gathered.scales, bf16.scales);
        if (recipe == Fp8Recipe::Delayed) EXPECT_FALSE(gathered.scales.empty());
      }
    }
  }
}

// NOTE [FP8 all-gather pieces] with precision.fp8_routed_experts false (NOTE [FP8 routed
// experts switch] in model/fp8_projections.h): the routed experts' stacks gathered in bf16
// with the router and the norms and run through their grouped bf16 GEMMs, the other
// projections gathered as packed E4M3 codes, give bitwise the losses, gradient chunks and
// delayed scales of the bf16 gather with the same switch. Both models, ZeRO-3 and ZeRO-1.
TEST(GpuFsdp, Fp8AllGatherWithTheRoutedExpertsInBf16IsTheBf16Gather) {
  if (read_launch_env().world_size != 1) GTEST_SKIP() << "a one-rank test";
  ModelConfig moe = small_moe();
  moe.name = "gpu-fsdp-fp8-gather-moe-experts-bf16";
  moe.num_layers = 4;
  ModelConfig deepseek = small_deepseek(true);
  deepseek.name = "gpu-fsdp-fp8-gather-deepseek-v3-experts-bf16";
  deepseek.rope_scaling = RopeScaling{};
  deepseek.num_layers = 4;
  for (const ModelConfig& c : {moe, deepseek}) {
    for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
      for (const int stage : {3, 1}) {
        SCOPED_TRACE(testing::Message() << c.name << " " << (recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise")
                                        << " ZeRO-" << stage);
        Fp8Settings settings;
        settings.recipe = recipe;
        settings.routed_experts = false;
        const Fp8FsdpTrace bf16 = fp8_steps(c, settings, true, stage, false);
        const Fp8FsdpTrace gathered = fp8_steps(c, settings, true, stage, true);
        ASSERT_EQ(gathered.losses.size(), bf16.losses.size());
        for (double loss : gathered.losses) EXPECT_TRUE(std::isfinite(loss));
        EXPECT_EQ(gathered.losses, bf16.losses);
        ASSERT_EQ(gathered.grads.size(), bf16.grads.size());
        for (size_t i = 0; i < gathered.grads.size(); ++i)
          EXPECT_TRUE(gathered.grads[i] == bf16.grads[i]) << "step " << i;
        EXPECT_EQ(gathered.scales, bf16.scales);
        if (recipe == Fp8Recipe::Delayed) EXPECT_FALSE(gathered.scales.empty());
      }
    }
  }
}

}  // namespace
}  // namespace forge::gpu_test
