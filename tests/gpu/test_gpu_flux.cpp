// A whole FLUX transformer step on the GPU (bf16, every FLUX op's CUDA kernel, cuBLASLt
// GEMMs with biases, cuDNN's bidirectional attention) against the CPU reference on the same
// bf16-representable weights and inputs: the predicted velocity and every parameter's
// gradient; and full activation checkpointing on the GPU against none.
#include <gtest/gtest.h>

#include "gpu_testing.h"
#include "model/flux_parameters.h"
#include "model/flux_transformer.h"

namespace forge {
namespace {

using gpu_test::relative_l2;

// flux-debug with heads of 32 (rotary axes 8/12/12): 2 double and 2 single blocks.
FluxConfig gpu_flux_config() {
  FluxConfig c = flux_preset("flux-debug");
  c.head_dim = 32;
  c.axes_dim = {8, 12, 12};
  return c;
}

struct FluxStep {
  Tensor out;
  FluxParameters grads;
  FluxStep(const FluxConfig& c, Device device) : grads(c, device, DType::F32) {}
};

struct FluxCase {
  FluxConfig config = gpu_flux_config();
  FluxShape shape;
  FluxParameters cpu_params{config};
  Tensor image, text, pooled, dout;
  std::vector<float> timesteps{0.25f, 0.9f}, guidance{3.5f, 2.0f};

  FluxCase() {
    shape.batch = 2;
    shape.text_tokens = 8;
    shape.grid_h = 4;
    shape.grid_w = 6;
    Rng rng(gpu_test::seed_for_current_test());
    for (size_t i = 0; i < cpu_params.specs().size(); ++i) {
      const Tensor& t = cpu_params.tensors()[i];
      const bool matrix = t.ndim() == 2;
      const bool bias = cpu_params.specs()[i].name.ends_with(".bias");
      const Tensor values =
          gpu_test::random_bf16_values(t.shape(), rng, matrix ? 0.7 / std::sqrt(static_cast<double>(t.dim(1))) : 0.2);
      for (int64_t j = 0; j < t.numel(); ++j) t.data<float>()[j] = (matrix || bias ? 0.0f : 1.0f) + values.data<float>()[j];
    }
    gpu_test::round_to_bf16(cpu_params.flat());
    image = gpu_test::random_bf16_values({shape.batch, shape.image_tokens(), config.in_channels}, rng);
    text = gpu_test::random_bf16_values({shape.batch, shape.text_tokens, config.context_dim}, rng);
    pooled = gpu_test::random_bf16_values({shape.batch, config.pooled_dim}, rng);
    dout = gpu_test::random_bf16_values({shape.batch, shape.image_tokens(), config.in_channels}, rng, 0.1);
  }

  FluxStep run(Device device, ActivationCheckpoint checkpoint) {
    const DType dt = device == Device::CUDA ? DType::BF16 : DType::F32;
    FluxParameters params(config, device, dt);
    params.assign_from(cpu_params);
    auto place = [&](const Tensor& t) { return device == Device::CUDA ? gpu_test::to_gpu(t, dt) : t; };
    FluxInputs inputs{place(image), place(text), place(pooled), timesteps, guidance};
    FluxStep step(config, device);
    step.grads.zero();
    FluxTransformer model(config, shape, device, checkpoint);
    Tensor out = Tensor::empty(dout.shape(), dt, device);
    model.forward(inputs, params, out);
    model.backward(place(dout), params, step.grads);
    step.out = device == Device::CUDA ? gpu_test::to_cpu_f32(out) : out;
    return step;
  }
};

TEST(GpuFlux, StepMatchesCpuReference) {
  FluxCase c;
  const FluxStep cpu = c.run(Device::CPU, ActivationCheckpoint::None);
  const FluxStep gpu = c.run(Device::CUDA, ActivationCheckpoint::None);
  EXPECT_LT(relative_l2(gpu.out, cpu.out), 2e-2);
  const Tensor gpu_grads = gpu_test::to_cpu_f32(gpu.grads.flat());
  for (size_t i = 0; i < cpu.grads.specs().size(); ++i) {
    const Tensor& want = cpu.grads.tensors()[i];
    const int64_t offset = static_cast<int64_t>(static_cast<const float*>(want.raw()) - cpu.grads.flat().data<float>());
    const Tensor got = gpu_grads.narrow(offset, offset + want.numel());
    EXPECT_LT(relative_l2(got, want.view({want.numel()})), 5e-2) << cpu.grads.specs()[i].name;
  }
}

TEST(GpuFlux, FullCheckpointingMatchesNone) {
  FluxCase c;
  const FluxStep none = c.run(Device::CUDA, ActivationCheckpoint::None);
  const FluxStep full = c.run(Device::CUDA, ActivationCheckpoint::Full);
  EXPECT_LT(relative_l2(full.out, none.out), 1e-6);
  EXPECT_LT(relative_l2(gpu_test::to_cpu_f32(full.grads.flat()), gpu_test::to_cpu_f32(none.grads.flat())), 1e-3);
}

}  // namespace
}  // namespace forge
