// FP8 tensorwise training on the GPU (NOTE [FP8 tensorwise linear] in ops/fp8_linear.h)
// against the CPU FP8 reference on the same bf16 values: the three linear ops with an
// FP8 descriptor (outputs poisoned first), and one training micro-batch of a small model
// with Fp8Projections (model/fp8_projections.h): E5M2 gradients with the head in bf16, and
// E4M3 gradients with the head in FP8.
//
// The ops: both sides quantize the same values with the same torchao scale (the casts and
// the device scale are bitwise the CPU's, GpuFp8.*), so the codes agree and what differs
// is the GEMM's summation (fp32 on both; Hopper's fast accumulation in the forward) and
// the bf16 rounding of y and dx: kBf16Tolerance for y and dx, kF32Tolerance for the fp32 dW.
// The micro-batch: the GPU's activations are bf16 where the CPU's are fp32, and an FP8
// cast of a slightly different value lands on a neighbouring code now and then (E4M3's
// step is 2^-3 relative, bf16's 2^-8: about one element in 30 moves by one FP8 step), on
// top of the bf16 model's own differences (5% in GpuLora's micro-batch): gradients within
// 10% (relative L2), the loss within 1%. A wrong operand (transposed, unscaled, the wrong
// format) is off by 50% or more.
#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_testing.h"

#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "ops/linear.h"

namespace forge {
namespace {

using namespace gpu_test;

Fp8LinearWorkspace device_workspace(int64_t codes) {
  return {poisoned_gpu({codes}, DType::U8), poisoned_gpu({codes}, DType::U8), poisoned_gpu({codes}, DType::U8),
          poisoned_gpu({kFp8WorkspaceStats}, DType::F32)};
}

struct Fp8OpCase {
  int64_t tokens, in, out;
  Fp8Format grad_format;
};

TEST(GpuFp8Linear, OpsMatchTheCpuReference) {
  Rng rng(seed_for_current_test());
  // k (in, out, tokens) a multiple of 16 and n x 2 (bf16 y, dx) or n x 4 (fp32 dW) bytes
  // a multiple of 16, as cuBLASLt's FP8 GEMM needs (NOTE [FP8 GEMM layout]).
  for (const Fp8OpCase c : {Fp8OpCase{128, 64, 192, Fp8Format::E5M2}, Fp8OpCase{256, 512, 384, Fp8Format::E5M2},
                            Fp8OpCase{512, 256, 1024, Fp8Format::E4M3}}) {
    SCOPED_TRACE(::testing::Message() << c.tokens << "x" << c.in << "x" << c.out << " " << fp8_format_name(c.grad_format));
    const Tensor x = random_bf16_values({c.tokens, c.in}, rng), w = random_bf16_values({c.out, c.in}, rng, 0.02);
    const Tensor dy = random_bf16_values({c.tokens, c.out}, rng, 1e-3);
    const Tensor residual = random_bf16_values({c.tokens, c.out}, rng);
    const Fp8Linear cpu_fp8{c.grad_format, nullptr};
    Fp8LinearWorkspace ws = device_workspace(std::max({c.tokens * c.in, c.tokens * c.out, c.out * c.in}));
    const Fp8Linear gpu_fp8{c.grad_format, &ws};
    const Tensor xg = to_gpu(x, DType::BF16), wg = to_gpu(w, DType::BF16), dyg = to_gpu(dy, DType::BF16);
    const LinearWeight cpu_w{w, nullptr, nullptr, &cpu_fp8}, gpu_w{wg, nullptr, nullptr, &gpu_fp8};

    Tensor y = Tensor::empty({c.tokens, c.out});
    linear_forward(y, x, cpu_w);
    Tensor yg = poisoned_gpu({c.tokens, c.out}, DType::BF16);
    linear_forward(yg, xg, gpu_w);
    EXPECT_LT(relative_l2(to_cpu_f32(yg), y), kBf16Tolerance) << "forward";

    linear_forward(y, x, cpu_w, &residual);
    yg = poisoned_gpu({c.tokens, c.out}, DType::BF16);
    const Tensor residual_g = to_gpu(residual, DType::BF16);
    linear_forward(yg, xg, gpu_w, &residual_g);
    EXPECT_LT(relative_l2(to_cpu_f32(yg), y), kBf16Tolerance) << "forward with a residual";
    Tensor in_place = to_gpu(residual, DType::BF16);
    linear_forward(in_place, xg, gpu_w, &in_place);
    EXPECT_LT(relative_l2(to_cpu_f32(in_place), y), kBf16Tolerance) << "forward into the residual itself";

    Tensor dx = Tensor::empty({c.tokens, c.in});
    linear_backward_input(dx, dy, cpu_w);
    Tensor dxg = poisoned_gpu({c.tokens, c.in}, DType::BF16);
    linear_backward_input(dxg, dyg, gpu_w);
    EXPECT_LT(relative_l2(to_cpu_f32(dxg), dx), kBf16Tolerance) << "input gradient";

    Tensor dw = Tensor::empty({c.out, c.in});
    linear_backward_weight(LinearWeight{dw, nullptr, nullptr, &cpu_fp8}, dy, x, true);
    Tensor dwg = poisoned_gpu({c.out, c.in}, DType::F32);
    const LinearWeight gpu_grad{dwg, nullptr, nullptr, &gpu_fp8};
    linear_backward_weight(gpu_grad, dyg, xg, true);
    EXPECT_LT(relative_l2(to_cpu_f32(dwg), dw), kF32Tolerance) << "weight gradient written over";
    linear_backward_weight(LinearWeight{dw, nullptr, nullptr, &cpu_fp8}, dy, x, false);
    linear_backward_weight(gpu_grad, dyg, xg, false);
    EXPECT_LT(relative_l2(to_cpu_f32(dwg), dw), kF32Tolerance) << "weight gradient added";

    // Both backward GEMMs in one call (dy quantized once, its transpose from the same
    // cast) equal the two ops bit for bit, written over and added to.
    for (const bool overwrite : {true, false}) {
      Tensor dx_one = poisoned_gpu({c.tokens, c.in}, DType::BF16);
      Tensor dw_one = to_gpu(to_cpu_f32(dwg), DType::F32), dw_two = to_gpu(to_cpu_f32(dwg), DType::F32);
      Tensor dx_two = poisoned_gpu({c.tokens, c.in}, DType::BF16);
      linear_backward(dx_one, LinearWeight{dw_one, nullptr, nullptr, &gpu_fp8}, dyg, xg, gpu_w, overwrite);
      linear_backward_input(dx_two, dyg, gpu_w);
      linear_backward_weight(LinearWeight{dw_two, nullptr, nullptr, &gpu_fp8}, dyg, xg, overwrite);
      EXPECT_EQ(host_values<uint16_t>(dx_one), host_values<uint16_t>(dx_two)) << "one-call input gradient";
      EXPECT_EQ(host_values<float>(dw_one), host_values<float>(dw_two)) << "one-call weight gradient";
    }

    // With the projection's forward statistics (NOTE [FP8 forward statistics]) the backward
    // skips the amax of x and W and gets the same bits; for other tensors than the
    // forward's it computes them itself, the same bits again.
    const Tensor saved = poisoned_gpu({kFp8WorkspaceStats}, DType::F32);
    Fp8ForwardStats forward{saved.data<float>()};
    const Fp8Linear kept_fp8{c.grad_format, &ws, &forward};
    const LinearWeight kept_w{wg, nullptr, nullptr, &kept_fp8};
    Tensor y_kept = poisoned_gpu({c.tokens, c.out}, DType::BF16), y_plain = poisoned_gpu({c.tokens, c.out}, DType::BF16);
    linear_forward(y_kept, xg, kept_w);
    linear_forward(y_plain, xg, gpu_w);
    EXPECT_EQ(host_values<uint16_t>(y_kept), host_values<uint16_t>(y_plain)) << "forward keeping its statistics";
    const Tensor x_copy = to_gpu(x, DType::BF16), w_copy = to_gpu(w, DType::BF16);
    for (const bool same_tensors : {true, false}) {
      SCOPED_TRACE(same_tensors ? "the forward's tensors" : "copies of them");
      const Tensor& xb = same_tensors ? xg : x_copy;
      const LinearWeight wb{same_tensors ? wg : w_copy, nullptr, nullptr, &kept_fp8};
      Tensor dx_kept = poisoned_gpu({c.tokens, c.in}, DType::BF16), dx_plain = poisoned_gpu({c.tokens, c.in}, DType::BF16);
      Tensor dw_kept = poisoned_gpu({c.out, c.in}, DType::F32), dw_plain = poisoned_gpu({c.out, c.in}, DType::F32);
      linear_backward(dx_kept, LinearWeight{dw_kept, nullptr, nullptr, &kept_fp8}, dyg, xb, wb, true);
      linear_backward(dx_plain, LinearWeight{dw_plain, nullptr, nullptr, &gpu_fp8}, dyg, xg, gpu_w, true);
      EXPECT_EQ(host_values<uint16_t>(dx_kept), host_values<uint16_t>(dx_plain)) << "input gradient";
      EXPECT_EQ(host_values<float>(dw_kept), host_values<float>(dw_plain)) << "weight gradient";
      linear_backward_input(dx_kept, dyg, wb);
      linear_backward_weight(LinearWeight{dw_kept, nullptr, nullptr, &kept_fp8}, dyg, xb, true);
      EXPECT_EQ(host_values<uint16_t>(dx_kept), host_values<uint16_t>(dx_plain)) << "separate input gradient";
      EXPECT_EQ(host_values<float>(dw_kept), host_values<float>(dw_plain)) << "separate weight gradient";
    }
  }
}

TEST(GpuFp8Linear, TrainingMicroBatchMatchesCpuFp8) {
  const ModelConfig config = small_model("fp8-gpu");
  const int64_t batch = 2, seq = 64;

  FlatParameters params(config);
  params.initialize(3);
  round_to_bf16(params.flat());  // the GPU's bf16 weights, on both sides
  FlatParameters weights_gpu(config, Device::CUDA, DType::BF16), grads_bf16(config, Device::CUDA, DType::F32);
  weights_gpu.assign_from(params);

  Rng rng(seed_for_current_test());
  Tensor tokens = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
  Tensor targets = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
  const Tensor tokens_g = tokens.to(Device::CUDA), targets_g = targets.to(Device::CUDA);
  DecoderLM model_cpu(config, batch, seq);
  DecoderLM model_gpu(config, batch, seq, Device::CUDA, DType::BF16, ActivationCheckpoint::None);
  const float scale = 1.0f / static_cast<float>(batch * seq);
  grads_bf16.discard();
  const double loss_bf16 = model_gpu.forward_backward(tokens_g, targets_g, weights_gpu, grads_bf16, scale).mean();

  for (const Fp8Settings settings : {Fp8Settings{Fp8Format::E5M2, false}, Fp8Settings{Fp8Format::E4M3, true}}) {
    SCOPED_TRACE(::testing::Message() << fp8_format_name(settings.grad_format)
                                      << (settings.output_head ? ", FP8 head" : ", bf16 head"));
    FlatParameters grads_cpu(config), grads_gpu(config, Device::CUDA, DType::F32);
    Fp8Projections cpu(config, settings, Device::CPU, batch * seq), gpu(config, settings, Device::CUDA, batch * seq);
    cpu.set_base(params, grads_cpu);
    gpu.set_base(weights_gpu, grads_gpu);
    grads_cpu.discard();
    grads_gpu.discard();
    const double loss_cpu = model_cpu.forward_backward(tokens, targets, cpu, cpu, scale).mean();
    const double loss_gpu = model_gpu.forward_backward(tokens_g, targets_g, gpu, gpu, scale).mean();
    EXPECT_NEAR(loss_gpu, loss_cpu, 1e-2 * loss_cpu);
    EXPECT_NE(loss_gpu, loss_bf16);  // the FP8 GEMMs ran
    for (size_t k = 0; k < params.specs().size(); ++k)
      EXPECT_LT(relative_l2(to_cpu_f32(grads_gpu.tensors()[k]), grads_cpu.tensors()[k]), 0.1)
          << params.specs()[k].name;
  }
}

// What a few steps of FP8 training on the GPU gave: every micro-batch's loss and fp32
// gradients, and the delayed scales at the end (empty under tensorwise).
struct Fp8StepTrace {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
  std::vector<float> scales;
};

// Three steps of two micro-batches each of `config` from `params` with `settings`; between
// steps, the optimizer's turn: every weight of `params` scaled by weight_factor(step).
Fp8StepTrace fp8_steps(const ModelConfig& config, const FlatParameters& params, const Tensor& tokens,
                       const Tensor& targets, const Fp8Settings& settings, ActivationCheckpoint mode,
                       const std::function<float(int)>& weight_factor) {
  const int64_t batch = tokens.dim(0), seq = tokens.dim(1);
  const float scale = 1.0f / static_cast<float>(batch * seq);
  FlatParameters weights(config, Device::CUDA, DType::BF16), g(config, Device::CUDA, DType::F32);
  weights.assign_from(params);
  Fp8Projections fp8(config, settings, Device::CUDA, batch * seq);
  fp8.set_base(weights, g);
  DecoderLM model(config, batch, seq, Device::CUDA, DType::BF16, mode);
  Fp8StepTrace trace;
  for (int step = 0; step < 3; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      g.discard();
      trace.losses.push_back(model.forward_backward(tokens, targets, fp8, fp8, scale).mean());
      trace.grads.push_back(host_values<float>(g.flat()));
    }
    fp8.end_step(true);
    FlatParameters changed(config);
    changed.assign_from(params);
    for (int64_t i = 0; i < changed.flat().numel(); ++i) changed.flat().data<float>()[i] *= weight_factor(step);
    weights.assign_from(changed);
  }
  if (settings.recipe == Fp8Recipe::Delayed) trace.scales = fp8.delayed_state().scales;
  return trace;
}

void expect_same_losses_and_gradients(const Fp8StepTrace& got, const Fp8StepTrace& want) {
  EXPECT_EQ(got.losses, want.losses);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < want.grads.size(); ++i) EXPECT_TRUE(got.grads[i] == want.grads[i]) << "micro-batch " << i;
}

// Random token ids and targets [batch, seq] on the GPU.
std::pair<Tensor, Tensor> random_batch(const ModelConfig& config, int64_t batch, int64_t seq, Rng& rng) {
  const Tensor tokens = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA);
  return {tokens, random_ids(batch * seq, config.vocab_size, rng).view({batch, seq}).to(Device::CUDA)};
}

// NOTE [FP8 weight cache]: with the weights cast once per step (and kept across the
// micro-batches, activation checkpointing's recomputation and a changed weight after the
// step's end) every loss and gradient is bitwise the uncached run's, for both recipes.
// fp8_linear_backward casts dy once into its codes and their transpose, also for token
// counts the weight gradient pads to 16 (a routed expert's rows): dx, dW (added to what it
// holds) and the statistics block are bitwise the two separate calls', under `tensorwise`
// and `delayed`, in both gradient formats.
TEST(GpuFp8Linear, OneBackwardCallGivesTheSeparateCallsBits) {
  Rng rng(seed_for_current_test());
  const int64_t in = 96, out = 80;
  for (const int64_t tokens : {int64_t{64}, int64_t{37}, int64_t{5}}) {
    for (const Fp8Format grad_format : {Fp8Format::E5M2, Fp8Format::E4M3}) {
      for (const bool delayed : {false, true}) {
        SCOPED_TRACE(std::to_string(tokens) + " tokens, " + (grad_format == Fp8Format::E5M2 ? "e5m2" : "e4m3") +
                     (delayed ? ", delayed" : ", tensorwise"));
        const Tensor x = to_gpu(random_bf16_values({tokens, in}, rng), DType::BF16);
        const Tensor w = to_gpu(random_bf16_values({out, in}, rng, 0.05), DType::BF16);
        const Tensor dy = to_gpu(random_bf16_values({tokens, out}, rng, 0.01), DType::BF16);
        const Tensor grad0 = to_gpu(random_f32({out, in}, rng), DType::F32);
        std::vector<float> block(cpu::kFp8ProjectionStats);
        cpu::fp8_init_stats(block.data(), 1);
        if (delayed)  // scales a step's update could have left: x's, W's and dy's
          for (const auto& [role, scale] : {std::pair{cpu::Fp8Role::X, 64.0f}, std::pair{cpu::Fp8Role::W, 2048.0f},
                                            std::pair{cpu::Fp8Role::Dy, 4096.0f}}) {
            block[cpu::fp8_scale_offset(0, role)] = scale;
            block[cpu::fp8_scale_inv_offset(0, role)] = 1.0f / scale;
          }
        std::vector<Tensor> dx, dw, stats;
        for (const bool one_call : {false, true}) {
          Fp8LinearWorkspace ws = device_workspace(2 * out * in);
          Tensor block_gpu = Tensor::empty({cpu::kFp8ProjectionStats});
          std::copy(block.begin(), block.end(), block_gpu.data<float>());
          block_gpu = block_gpu.to(Device::CUDA);
          Fp8Linear fp8;
          fp8.grad_format = grad_format;
          fp8.workspace = &ws;
          fp8.stats = block_gpu.data<float>();
          fp8.delayed = delayed;
          fp8.varying_tokens = true;
          dx.push_back(poisoned_gpu({tokens, in}, DType::BF16));
          dw.push_back(grad0.clone());
          if (one_call) {
            fp8_linear_backward(dx.back(), dw.back(), dy, w, x, fp8, /*overwrite=*/false);
          } else {
            fp8_linear_backward_input(dx.back(), dy, w, fp8);
            fp8_linear_backward_weight(dw.back(), dy, x, fp8, /*overwrite=*/false);
          }
          stats.push_back(block_gpu);
        }
        EXPECT_EQ(host_values<uint16_t>(dx[1]), host_values<uint16_t>(dx[0]));
        EXPECT_EQ(host_values<uint32_t>(dw[1]), host_values<uint32_t>(dw[0]));
        EXPECT_EQ(host_values<uint32_t>(stats[1]), host_values<uint32_t>(stats[0]));
      }
    }
  }
}

TEST(GpuFp8Linear, WeightCacheGivesTheSameBits) {
  const ModelConfig config = small_model("fp8-cache-gpu");
  FlatParameters params(config);
  params.initialize(5);
  Rng rng(seed_for_current_test());
  const auto [tokens, targets] = random_batch(config, 2, 64, rng);
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    SCOPED_TRACE(recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise");
    std::vector<Fp8StepTrace> runs;
    for (const bool cache : {false, true}) {
      Fp8Settings settings;
      settings.recipe = recipe;
      settings.weight_cache = cache;
      settings.output_head = true;
      runs.push_back(fp8_steps(config, params, tokens, targets, settings, ActivationCheckpoint::Full,
                               [](int step) { return 1.0f + 0.01f * (step + 1); }));
    }
    expect_same_losses_and_gradients(runs[1], runs[0]);
  }
}

// NOTE [FP8 fused producers]: with the amax passes (tensorwise) and x's casts (delayed) done
// by RMSNorm and SwiGLU, every loss, gradient and delayed scale is bitwise the unfused
// run's, under each activation checkpointing mode (selective and full recompute the
// producers without or with the projection that reads them), over steps whose weights move.
TEST(GpuFp8Linear, FusedProducersGiveTheSameBits) {
  const ModelConfig config = small_model("fp8-producers-gpu");
  FlatParameters params(config);
  params.initialize(6);
  Rng rng(seed_for_current_test());
  const auto [tokens, targets] = random_batch(config, 2, 64, rng);
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed})
    for (const ActivationCheckpoint mode :
         {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full}) {
      SCOPED_TRACE(testing::Message() << (recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise") << ", checkpoint "
                                      << static_cast<int>(mode));
      std::vector<Fp8StepTrace> runs;
      for (const bool fused : {false, true}) {
        Fp8Settings settings;
        settings.recipe = recipe;
        settings.fused_producers = fused;
        settings.weight_cache = true;
        runs.push_back(fp8_steps(config, params, tokens, targets, settings, mode,
                                 [](int step) { return 1.0f - 0.02f * step; }));
      }
      expect_same_losses_and_gradients(runs[1], runs[0]);
      EXPECT_EQ(runs[1].scales, runs[0].scales);
    }
}

}  // namespace
}  // namespace forge
