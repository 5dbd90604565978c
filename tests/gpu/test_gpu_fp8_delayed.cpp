// precision.fp8 delayed on the GPU (NOTE [FP8 delayed scaling] in ops/fp8_linear.h, NOTE
// [FP8 step end] in model/fp8_projections.h) against the CPU reference: the step-end pass
// bit for bit (kernels/cuda/fp8_delayed.cu), the linear ops quantizing with the delayed
// scales (the same tolerances as GpuFp8Linear's, and the amaxes they fold in bit for bit),
// and two training steps of a small model whose weight scales agree bit for bit.
#include "gpu_testing.h"

#include <cmath>

#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "ops/fp8_statistics.h"
#include "ops/linear.h"

namespace forge {
namespace {

using namespace gpu_test;
using cpu::Fp8Role;

// The slots of the statistics blocks (seen, scale, scale_inv per role; the padding between
// them is never written) of a host tensor.
std::vector<float> slots(const Tensor& stats) {
  std::vector<float> out;
  const int64_t projections = stats.numel() / cpu::kFp8ProjectionStats;
  for (int64_t p = 0; p < projections; ++p)
    for (int r = 0; r < cpu::kFp8Roles; ++r)
      for (int64_t k = 0; k < 3; ++k)
        out.push_back(stats.data<float>()[cpu::fp8_seen_offset(p, static_cast<Fp8Role>(r)) + k * cpu::kFp8StatStride]);
  return out;
}

std::vector<float> gpu_slots(const Tensor& stats) { return slots(stats.to(Device::CPU)); }

// The statistics blocks and histories of both sides, after fp8_stats_init.
struct Blocks {
  Tensor cpu_stats, gpu_stats, cpu_history, gpu_history;
  Blocks(int64_t projections, int64_t length)
      : cpu_stats(Tensor::empty({projections * cpu::kFp8ProjectionStats})),
        gpu_stats(poisoned_gpu({projections * cpu::kFp8ProjectionStats}, DType::F32)),
        cpu_history(Tensor::zeros({projections * cpu::kFp8Roles * length})),
        gpu_history(Tensor::zeros({projections * cpu::kFp8Roles * length}, DType::F32, Device::CUDA)) {
    fp8_stats_init(cpu_stats);
    fp8_stats_init(gpu_stats);
  }
};

TEST(GpuFp8Delayed, StepEndMatchesTheCpuBitForBit) {
  Rng rng(seed_for_current_test());
  const int64_t projections = 37;
  for (const auto algorithm : {cpu::Fp8AmaxAlgorithm::Max, cpu::Fp8AmaxAlgorithm::MostRecent})
    for (const int64_t length : {1, 3, 16}) {
      SCOPED_TRACE(::testing::Message() << "history " << length);
      Blocks b(projections, length);
      EXPECT_EQ(gpu_slots(b.gpu_stats), slots(b.cpu_stats));
      const cpu::Fp8DelayedRecipe recipe{length, algorithm, 1.0f, Fp8Format::E5M2};
      for (int step = 0; step < 6; ++step) {
        for (int64_t p = 0; p < projections; ++p)
          for (int r = 0; r < cpu::kFp8Roles; ++r) {  // wide magnitudes, and zeros now and then
            const float amax = rng.uniform() < 0.1 ? 0.0f : static_cast<float>(std::exp(4.0 * rng.normal()));
            b.cpu_stats.data<float>()[cpu::fp8_seen_offset(p, static_cast<Fp8Role>(r))] = amax;
          }
        b.gpu_stats.copy_from(b.cpu_stats);
        fp8_stats_delayed_step(b.cpu_stats, b.cpu_history, recipe);
        fp8_stats_delayed_step(b.gpu_stats, b.gpu_history, recipe);
        EXPECT_EQ(gpu_slots(b.gpu_stats), slots(b.cpu_stats));
        EXPECT_EQ(host_values<float>(b.gpu_history),
                  std::vector<float>(b.cpu_history.data<float>(),
                                     b.cpu_history.data<float>() + b.cpu_history.numel()));
      }
    }
  Blocks b(projections, 2);
  EXPECT_EQ(fp8_stats_first_nonfinite(b.gpu_stats), -1);
  b.cpu_stats.data<float>()[cpu::fp8_seen_offset(30, Fp8Role::X)] = INFINITY;
  b.cpu_stats.data<float>()[cpu::fp8_seen_offset(12, Fp8Role::Dy)] = NAN;
  b.gpu_stats.copy_from(b.cpu_stats);
  EXPECT_EQ(fp8_stats_first_nonfinite(b.gpu_stats), 12 * cpu::kFp8Roles + 2);
  EXPECT_EQ(fp8_stats_first_nonfinite(b.gpu_stats), fp8_stats_first_nonfinite(b.cpu_stats));
  EXPECT_TRUE(std::isnan(fp8_stats_seen(b.gpu_stats, 12 * cpu::kFp8Roles + 2)));
  fp8_stats_clear_seen(b.gpu_stats);
  EXPECT_EQ(fp8_stats_first_nonfinite(b.gpu_stats), -1);
}

// The three linear ops with delayed scales (set alike on both sides, unrelated to the
// tensors' own amaxes, a few of them small enough to saturate): outputs within the
// GpuFp8Linear tolerances, the amaxes folded into `seen` bit for bit, and the one-call
// backward bitwise the two ops.
TEST(GpuFp8Delayed, LinearOpsWithDelayedScalesMatchTheCpu) {
  Rng rng(seed_for_current_test());
  const int64_t tokens = 256, in = 512, out = 384;
  const Tensor x = random_bf16_values({tokens, in}, rng), w = random_bf16_values({out, in}, rng, 0.02);
  const Tensor dy = random_bf16_values({tokens, out}, rng, 1e-3);
  Blocks b(1, 1);
  const float scales[] = {448.0f / 3.0f, 448.0f / 0.05f, 57344.0f / 4e-3f};  // x, W, dy
  for (int r = 0; r < cpu::kFp8Roles; ++r) {
    b.cpu_stats.data<float>()[cpu::fp8_scale_offset(0, static_cast<Fp8Role>(r))] = scales[r];
    b.cpu_stats.data<float>()[cpu::fp8_scale_inv_offset(0, static_cast<Fp8Role>(r))] = 1.0f / scales[r];
  }
  b.gpu_stats.copy_from(b.cpu_stats);
  const int64_t codes = std::max({tokens * in, tokens * out, out * in});
  Fp8LinearWorkspace ws{poisoned_gpu({codes}, DType::U8), poisoned_gpu({codes}, DType::U8),
                        poisoned_gpu({codes}, DType::U8), poisoned_gpu({kFp8WorkspaceStats}, DType::F32)};
  Fp8Linear cpu_fp8{Fp8Format::E5M2, nullptr, nullptr, b.cpu_stats.data<float>(), true};
  Fp8Linear gpu_fp8{Fp8Format::E5M2, &ws, nullptr, b.gpu_stats.data<float>(), true};
  const Tensor xg = to_gpu(x, DType::BF16), wg = to_gpu(w, DType::BF16), dyg = to_gpu(dy, DType::BF16);
  const LinearWeight cpu_w{w, nullptr, nullptr, &cpu_fp8}, gpu_w{wg, nullptr, nullptr, &gpu_fp8};

  Tensor y = Tensor::empty({tokens, out});
  linear_forward(y, x, cpu_w);
  Tensor yg = poisoned_gpu({tokens, out}, DType::BF16);
  linear_forward(yg, xg, gpu_w);
  EXPECT_LT(relative_l2(to_cpu_f32(yg), y), kBf16Tolerance) << "forward";

  Tensor dx = Tensor::empty({tokens, in}), dw = Tensor::empty({out, in});
  linear_backward(dx, LinearWeight{dw, nullptr, nullptr, &cpu_fp8}, dy, x, cpu_w, true);
  Tensor dxg = poisoned_gpu({tokens, in}, DType::BF16), dwg = poisoned_gpu({out, in}, DType::F32);
  linear_backward(dxg, LinearWeight{dwg, nullptr, nullptr, &gpu_fp8}, dyg, xg, gpu_w, true);
  EXPECT_LT(relative_l2(to_cpu_f32(dxg), dx), kBf16Tolerance) << "input gradient";
  EXPECT_LT(relative_l2(to_cpu_f32(dwg), dw), kF32Tolerance) << "weight gradient";

  Tensor dx_two = poisoned_gpu({tokens, in}, DType::BF16), dw_two = poisoned_gpu({out, in}, DType::F32);
  linear_backward_input(dx_two, dyg, gpu_w);
  linear_backward_weight(LinearWeight{dw_two, nullptr, nullptr, &gpu_fp8}, dyg, xg, true);
  EXPECT_EQ(host_values<uint16_t>(dx_two), host_values<uint16_t>(dxg)) << "separate input gradient";
  EXPECT_EQ(host_values<float>(dw_two), host_values<float>(dwg)) << "separate weight gradient";

  const std::vector<float> gpu_stats = host_values<float>(b.gpu_stats);
  for (int r = 0; r < cpu::kFp8Roles; ++r) {
    const auto role = static_cast<Fp8Role>(r);
    EXPECT_EQ(gpu_stats[cpu::fp8_seen_offset(0, role)], b.cpu_stats.data<float>()[cpu::fp8_seen_offset(0, role)])
        << cpu::fp8_role_name(role);
    EXPECT_GT(gpu_stats[cpu::fp8_seen_offset(0, role)], 0.0f);
    EXPECT_EQ(gpu_stats[cpu::fp8_scale_offset(0, role)], scales[r]) << "the op must not change the delayed scale";
  }
}

// Two steps of a small model in delayed FP8 on both sides (the first with current scales,
// the second with the history's): losses within 1%, the weight scales bit for bit (the
// weights are the same bf16 values on both sides), the activations' and gradients' scales
// within a few percent (bf16 against fp32 activations). Gradients within 15% relative L2:
// GpuFp8Linear's micro-batch stays under 10% on its data, this one measured 10.4% at most
// (layers.0.attention.qkv, on the H100), the same FP8 code flips between the bf16 and fp32
// activations (the file header of test_gpu_fp8_linear.cpp).
TEST(GpuFp8Delayed, TrainingStepsMatchCpu) {
  const ModelConfig config = small_model("fp8-delayed-gpu");
  const int64_t batch = 2, seq = 64;
  FlatParameters params(config);
  params.initialize(3);
  round_to_bf16(params.flat());
  FlatParameters weights_gpu(config, Device::CUDA, DType::BF16);
  weights_gpu.assign_from(params);
  Rng rng(seed_for_current_test());
  const Tensor tokens = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
  const Tensor targets = random_ids(batch * seq, config.vocab_size, rng).view({batch, seq});
  const Tensor tokens_g = tokens.to(Device::CUDA), targets_g = targets.to(Device::CUDA);
  DecoderLM model_cpu(config, batch, seq);
  DecoderLM model_gpu(config, batch, seq, Device::CUDA, DType::BF16, ActivationCheckpoint::None);
  const float scale = 1.0f / static_cast<float>(batch * seq);
  Fp8Settings settings;
  settings.recipe = Fp8Recipe::Delayed;
  settings.amax_history_length = 4;
  FlatParameters grads_cpu(config), grads_gpu(config, Device::CUDA, DType::F32);
  Fp8Projections cpu(config, settings, Device::CPU, batch * seq), gpu(config, settings, Device::CUDA, batch * seq);
  cpu.set_base(params, grads_cpu);
  gpu.set_base(weights_gpu, grads_gpu);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    grads_cpu.discard();
    grads_gpu.discard();
    const double loss_cpu = model_cpu.forward_backward(tokens, targets, cpu, cpu, scale).mean();
    const double loss_gpu = model_gpu.forward_backward(tokens_g, targets_g, gpu, gpu, scale).mean();
    EXPECT_NEAR(loss_gpu, loss_cpu, 1e-2 * loss_cpu);
    for (size_t k = 0; k < params.specs().size(); ++k)
      EXPECT_LT(relative_l2(to_cpu_f32(grads_gpu.tensors()[k]), grads_cpu.tensors()[k]), 0.15)
          << params.specs()[k].name;
    EXPECT_EQ(gpu.nonfinite_amax(), "");
    cpu.end_step(true);
    gpu.end_step(true);
    const Fp8DelayedState c = cpu.delayed_state(), g = gpu.delayed_state();
    ASSERT_EQ(c.scales.size(), g.scales.size());
    for (size_t i = 0; i < c.scales.size(); ++i) {
      if (i % cpu::kFp8Roles == 1)
        EXPECT_EQ(g.scales[i], c.scales[i]) << "weight scale " << i / 3;
      else
        EXPECT_NEAR(g.scales[i], c.scales[i], 0.05 * c.scales[i]) << "scale " << i;
    }
  }
}

}  // namespace
}  // namespace forge
