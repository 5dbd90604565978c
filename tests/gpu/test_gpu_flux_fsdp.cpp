// FLUX under FSDP on the GPU with one rank (NCCL over a communicator of one; NOTE [FLUX
// FSDP]): in every ZeRO stage and both reduce dtypes, three steps of two micro-batches
// through FluxFsdp (the communication stream, ZeRO-3's rotating gather buffers over FLUX's
// four blocks, the reductions into the fp32 chunk, AdamW on the segments writing the bf16
// copies) predict what the single-device CUDA path predicts and end at its master weights.
// The multi-GPU run is forge launch over train (README, FLUX.1: Data-parallel training).
#include <gtest/gtest.h>

#include <cmath>

#include "distributed/flux_fsdp.h"
#include "distributed/launch_env.h"
#include "gpu_testing.h"
#include "model/flux_transformer.h"
#include "ops/adamw.h"
#include "optim/optimizer.h"

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

constexpr int kSteps = 3, kAccum = 2;

struct Batch {
  Tensor image, text, pooled, dout;
};

struct Trained {
  std::vector<Tensor> outputs;  // fp32 on the CPU, per micro-batch
  Tensor weights;               // fp32 master weights, flux_parameter_specs end to end, on the CPU
};

struct Case {
  FluxConfig config = gpu_flux_config();
  FluxShape shape{2, 8, 4, 6};
  FluxParameters init{config};
  std::vector<Batch> batches;
  std::vector<float> timesteps{0.25f, 0.9f}, guidance{3.5f, 2.0f};

  Case() {
    init.initialize(5);
    Rng rng(gpu_test::seed_for_current_test());
    for (int i = 0; i < kSteps * kAccum; ++i)
      batches.push_back({gpu_test::to_gpu(gpu_test::random_bf16_values({shape.batch, shape.image_tokens(),
                                                                        config.in_channels}, rng), DType::BF16),
                         gpu_test::to_gpu(gpu_test::random_bf16_values({shape.batch, shape.text_tokens,
                                                                        config.context_dim}, rng), DType::BF16),
                         gpu_test::to_gpu(gpu_test::random_bf16_values({shape.batch, config.pooled_dim}, rng),
                                          DType::BF16),
                         gpu_test::to_gpu(gpu_test::random_bf16_values({shape.batch, shape.image_tokens(),
                                                                        config.in_channels}, rng, 0.1), DType::BF16)});
  }

  AdamWHyper hyper(int step, float clip) const {
    AdamWHyper h;
    h.lr = 1e-3;
    h.step = step + 1;
    h.grad_scale = clip;
    return h;
  }

  Trained single_device() {
    FluxParameters master(config, Device::CUDA, DType::F32), compute(config, Device::CUDA, DType::BF16),
        grads(config, Device::CUDA, DType::F32), m(config, Device::CUDA, DType::F32), v(config, Device::CUDA, DType::F32);
    master.assign_from(init);
    compute.assign_from(master);
    grads.zero();
    m.zero();
    v.zero();
    FluxTransformer model(config, shape, Device::CUDA, ActivationCheckpoint::Full);
    Trained run;
    for (int step = 0; step < kSteps; ++step) {
      for (int a = 0; a < kAccum; ++a) {
        const Batch& b = batches[static_cast<size_t>(step * kAccum + a)];
        Tensor out = Tensor::empty(b.dout.shape(), DType::BF16, Device::CUDA);
        model.forward({b.image, b.text, b.pooled, timesteps, guidance}, compute, out);
        model.backward(b.dout, compute, grads, a == 0);
        run.outputs.push_back(gpu_test::to_cpu_f32(out));
      }
      const double norm = global_grad_norm({grads.flat()});
      for (const bool decayed : {true, false}) {
        auto region = [&](const FluxParameters& p) { return decayed ? p.decayed() : p.not_decayed(); };
        AdamWHyper h = hyper(step, clip_coefficient(norm, 1.0));
        h.weight_decay = decayed ? 0.1 : 0.0;
        adamw_update(region(master), region(grads), region(m), region(v), h, region(compute));
      }
    }
    FluxParameters host(config);
    host.assign_from(master);
    run.weights = Tensor::zeros({config.total_params()});
    int64_t offset = 0;
    for (const Tensor& t : host.tensors()) {
      run.weights.narrow(offset, offset + t.numel()).copy_from(t.view({t.numel()}));
      offset += t.numel();
    }
    return run;
  }

  Trained sharded(int stage, DType reduce) {
    ProcessGroupOptions options;
    options.device = Device::CUDA;
    auto group = create_process_group(LaunchEnv{}, options);
    FsdpOptions fsdp_options;
    fsdp_options.zero_stage = stage;
    fsdp_options.reduce_dtype = reduce;
    FluxFsdp flux(config, Device::CUDA, *group, nullptr, fsdp_options);
    Fsdp& fsdp = flux.fsdp();
    const Tensor flat = [&] {
      Tensor f = Tensor::zeros({config.total_params()});
      int64_t offset = 0;
      for (const Tensor& t : init.tensors()) {
        f.narrow(offset, offset + t.numel()).copy_from(t.view({t.numel()}));
        offset += t.numel();
      }
      return f;
    }();
    fsdp.load_master([&](int64_t offset, std::span<float> out) {
      std::copy_n(flat.data<float>() + offset, out.size(), out.data());
    });
    std::vector<Tensor> m, v;
    for (const Tensor& s : fsdp.master_segments()) {
      m.push_back(Tensor::zeros(s.shape(), DType::F32, Device::CUDA));
      v.push_back(Tensor::zeros(s.shape(), DType::F32, Device::CUDA));
    }
    FluxTransformer model(config, shape, Device::CUDA, ActivationCheckpoint::Full);
    Trained run;
    for (int step = 0; step < kSteps; ++step) {
      fsdp.begin_step();
      for (int a = 0; a < kAccum; ++a) {
        const Batch& b = batches[static_cast<size_t>(step * kAccum + a)];
        Tensor out = Tensor::empty(b.dout.shape(), DType::BF16, Device::CUDA);
        fsdp.begin_micro_batch(a == kAccum - 1);
        model.forward({b.image, b.text, b.pooled, timesteps, guidance}, flux, out);
        model.backward(b.dout, flux, flux, flux.overwrite_gradients(a));
        fsdp.end_micro_batch();
        run.outputs.push_back(gpu_test::to_cpu_f32(out));
      }
      fsdp.finish_gradients();
      const double norm = std::sqrt(fsdp.global_grad_sum_of_squares());
      const std::vector<FsdpSegment>& segments = fsdp.layout().segments();
      for (size_t i = 0; i < segments.size(); ++i) {
        AdamWHyper h = hyper(step, clip_coefficient(norm, 1.0));
        h.weight_decay = segments[i].weight_decay ? 0.1 : 0.0;
        adamw_update(fsdp.master_segments()[i], fsdp.grad_segments()[i], m[i], v[i], h, fsdp.compute_segments()[i]);
      }
      fsdp.refresh_compute_weights(true);
    }
    run.weights = Tensor::zeros({config.total_params()});
    for (size_t i = 0; i < fsdp.layout().segments().size(); ++i) {
      const FsdpSegment& s = fsdp.layout().segments()[i];
      run.weights.narrow(s.flat_offset, s.flat_offset + s.numel).copy_from(fsdp.master_segments()[i].to(Device::CPU));
    }
    return run;
  }
};

TEST(GpuFluxFsdp, OneRankTrainsLikeTheSingleDevicePath) {
  if (read_launch_env().world_size != 1) GTEST_SKIP() << "a one-rank test";
  Case c;
  const Trained single = c.single_device();
  Tensor start = Tensor::zeros({c.config.total_params()});
  int64_t offset = 0;
  for (const Tensor& t : c.init.tensors()) {
    start.narrow(offset, offset + t.numel()).copy_from(t.view({t.numel()}));
    offset += t.numel();
  }
  for (int stage : {1, 2, 3}) {
    for (DType reduce : {DType::F32, DType::BF16}) {
      const Trained got = c.sharded(stage, reduce);
      const bool f32 = reduce == DType::F32;
      for (size_t k = 0; k < got.outputs.size(); ++k)
        EXPECT_LT(relative_l2(got.outputs[k], single.outputs[k]), f32 ? 1e-2 : 3e-2)
            << "ZeRO-" << stage << " reduce " << dtype_name(reduce) << " micro-batch " << k;
      // The update (not the weights, which barely move in three steps) against the single
      // device's: fp32 reordering of the gradients' sums, or their bf16 rounding, moves it
      // by a little (Adam divides by the gradient's size).
      Tensor update_got = Tensor::empty(start.shape()), update_single = Tensor::empty(start.shape());
      for (int64_t i = 0; i < start.numel(); ++i) {
        update_got.data<float>()[i] = got.weights.data<float>()[i] - start.data<float>()[i];
        update_single.data<float>()[i] = single.weights.data<float>()[i] - start.data<float>()[i];
      }
      EXPECT_LT(relative_l2(update_got, update_single), f32 ? 2e-2 : 1e-1) << "ZeRO-" << stage << " reduce "
                                                                            << dtype_name(reduce);
    }
  }
}

}  // namespace
}  // namespace forge
