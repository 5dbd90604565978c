// CLIP's text encoder on the GPU against the CPU reference (gpu_testing.h): its new kernels
// (the affine LayerNorm, the exact and the quick GELU) on fresh random data, and the whole
// encoder (cuBLASLt GEMMs with biases, cuDNN's causal attention, bf16 activations) on the
// same bf16-representable weights, its last hidden state and pooled output.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "gpu_testing.h"
#include "model/clip_text_encoder.h"
#include "ops/gelu.h"
#include "ops/layer_norm.h"

namespace forge {
namespace {

using gpu_test::poisoned_gpu;
using gpu_test::random_bf16_values;
using gpu_test::relative_l2;
using gpu_test::seed_for_current_test;
using gpu_test::to_cpu_f32;
using gpu_test::to_gpu;

TEST(GpuClipOps, LayerNormMatchesCpu) {
  Rng rng(seed_for_current_test());
  // CLIP-L's rows (3 captions of 77 at 768), a width of an odd number of 16-byte vectors,
  // one row, and a width past 32 vectors per lane.
  for (const auto& [rows, dim] : std::vector<std::pair<int64_t, int64_t>>{{231, 768}, {5, 24}, {1, 8}, {301, 1288}}) {
    Tensor x = random_bf16_values({rows, dim}, rng);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += 3.0f;  // a mean the kernel must take out
    gpu_test::round_to_bf16(x);
    Tensor weight = random_bf16_values({dim}, rng), bias = random_bf16_values({dim}, rng);
    Tensor y = Tensor::empty({rows, dim});
    layer_norm_forward(y, x, weight, bias, 1e-5f);
    Tensor xg = to_gpu(x, DType::BF16), wg = to_gpu(weight, DType::BF16), bg = to_gpu(bias, DType::BF16);
    Tensor yg = poisoned_gpu({rows, dim}, DType::BF16);
    layer_norm_forward(yg, xg, wg, bg, 1e-5f);
    const std::string at = std::to_string(rows) + "x" + std::to_string(dim);
    EXPECT_LT(relative_l2(to_cpu_f32(yg), y), gpu_test::kBf16Tolerance) << at;
    layer_norm_forward(xg, xg, wg, bg, 1e-5f);  // in place: the same bits
    EXPECT_EQ(gpu_test::host_values<uint16_t>(xg), gpu_test::host_values<uint16_t>(yg)) << at;
  }
}

TEST(GpuClipOps, GeluErfAndQuickGeluMatchCpu) {
  Rng rng(seed_for_current_test());
  using Forward = void (*)(const Tensor&, const Tensor&);
  for (const auto& [name, forward] : std::vector<std::pair<std::string, Forward>>{
           {"gelu_erf", gelu_erf_forward}, {"quick_gelu", quick_gelu_forward}}) {
    // Sizes with a tail that is not a whole vector, and a start that is not 16-byte aligned.
    for (int64_t n : {1, 7, 8, 1000, 231 * 3072 + 5}) {
      Tensor in = random_bf16_values({n + 1}, rng, 3.0);
      Tensor out = Tensor::empty({n});
      forward(out, in.narrow(1, n + 1));
      Tensor ing = to_gpu(in, DType::BF16), outg = poisoned_gpu({n}, DType::BF16);
      forward(outg, ing.narrow(1, n + 1));
      EXPECT_LT(relative_l2(to_cpu_f32(outg), out), gpu_test::kBf16Tolerance) << name << " " << n;
      Tensor aligned = to_gpu(in, DType::BF16).narrow(0, n);
      Tensor expected = Tensor::empty({n});
      forward(expected, in.narrow(0, n));
      forward(aligned, aligned);  // in place
      EXPECT_LT(relative_l2(to_cpu_f32(aligned), expected), gpu_test::kBf16Tolerance) << name << " in place " << n;
    }
  }
}

// A small encoder with every piece: 2 layers of 128 (4 heads of 32), MLP 256, 77 positions.
ClipTextConfig gpu_clip_config(ClipActivation activation, int64_t eos_token_id) {
  ClipTextConfig c;
  c.name = "gpu-clip";
  c.vocab_size = 300;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_layers = 2;
  c.num_heads = 4;
  c.max_positions = 77;
  c.activation = activation;
  c.eos_token_id = eos_token_id;
  return c;
}

TEST(GpuClipTextEncoder, MatchesCpu) {
  for (const ClipActivation activation : {ClipActivation::QuickGelu, ClipActivation::GeluErf}) {
    const ClipTextConfig c = gpu_clip_config(activation, activation == ClipActivation::QuickGelu ? 2 : 299);
    Rng rng(seed_for_current_test() + static_cast<uint64_t>(activation));
    ClipTextParameters cpu(c);
    for (size_t i = 0; i < cpu.specs().size(); ++i) {
      const Tensor& t = cpu.tensors()[i];
      const bool norm_weight = cpu.specs()[i].name.find("norm") != std::string::npos && t.ndim() == 1 &&
                               cpu.specs()[i].name.ends_with("weight");
      const double scale = t.ndim() == 2 ? 1.0 / std::sqrt(static_cast<double>(t.dim(1))) : 0.2;
      for (int64_t j = 0; j < t.numel(); ++j)
        t.data<float>()[j] = static_cast<float>((norm_weight ? 1.0 : 0.0) + scale * rng.normal());
      gpu_test::round_to_bf16(t);
    }
    for (const Tensor* embedding : {&cpu.token_embedding(), &cpu.position_embedding()})
      for (int64_t j = 0; j < embedding->numel(); ++j)
        embedding->data<float>()[j] = to_float(to_bf16(static_cast<float>(0.5 * rng.normal())));
    ClipTextParameters gpu(c, Device::CUDA, DType::BF16);
    gpu.assign_from(cpu);

    // Three captions as the tokenizer makes them: start 298, words, end 299, padding.
    const int64_t batch = 3, seq = 77;
    std::vector<int32_t> tokens;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t words = std::vector<int64_t>{5, 75, 0}[static_cast<size_t>(b)];
      tokens.push_back(298);
      for (int64_t w = 0; w < words; ++w) tokens.push_back(static_cast<int32_t>(3 + rng.below(290)));
      tokens.push_back(299);
      const int32_t pad = activation == ClipActivation::QuickGelu ? 299 : 0;  // eos, or another token
      while (static_cast<int64_t>(tokens.size()) < (b + 1) * seq) tokens.push_back(pad);
    }
    ClipTextEncoder cpu_encoder(c, batch, seq, Device::CPU), gpu_encoder(c, batch, seq, Device::CUDA);
    Tensor last = Tensor::empty({batch, seq, c.hidden_size}), pooled = Tensor::empty({batch, c.hidden_size});
    cpu_encoder.forward(tokens, cpu, last, pooled);
    Tensor last_g = poisoned_gpu({batch, seq, c.hidden_size}, DType::BF16);
    Tensor pooled_g = poisoned_gpu({batch, c.hidden_size}, DType::BF16);
    gpu_encoder.forward(tokens, gpu, last_g, pooled_g);
    const std::string what(clip_activation_name(activation));
    EXPECT_LT(relative_l2(to_cpu_f32(last_g), last), 2e-2) << what;
    EXPECT_LT(relative_l2(to_cpu_f32(pooled_g), pooled), 2e-2) << what;
  }
}

}  // namespace
}  // namespace forge
