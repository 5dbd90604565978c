// FLUX VAE parameters: diffusers' AutoencoderKL names and forge's layouts (NOTE [FLUX VAE
// architecture] in flux_vae_config.h), all in one buffer on one device.
//
// NOTE [FLUX VAE parameters]
// Every parameter keeps its diffusers name (encoder.down_blocks.0.resnets.1.conv2.weight,
// decoder.up_blocks.0.upsamplers.0.conv.bias, ...), with two changes of layout:
//  - convolution weights are [O, K, K, I], PyTorch's [O, I, K, K] permuted (NOTE [NHWC
//    activations] in ops/conv2d.h);
//  - each mid block's attention has one fused projection, to_qkv ([3C, C] weight, [3C]
//    bias), the rows of to_q, to_k and to_v stacked, as the FLUX transformer fuses its own
//    (NOTE [Fused projections] in model/parameters.h): one GEMM gives the packed q, k, v.
// FluxVaeParamSpec::files lists the diffusers tensors a parameter is made of; loading
// (ckpt/flux_vae_weights.h) reads and permutes them. The buffer is fp32 on the CPU and the
// compute dtype on CUDA (bf16); each tensor starts on a multiple of 64 values, so the
// kernels' 16-byte loads of weights and biases stay aligned.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "model/flux_vae_config.h"

namespace forge {

// `rows` rows (along dim 0) of a parameter come from the diffusers tensor `name`.
struct FluxVaeFileTensor {
  std::string name;
  int64_t rows = 0;
};

struct FluxVaeParamSpec {
  std::string name;  // diffusers' name (the fused attention projections: ...to_qkv.weight / .bias)
  Shape shape;       // forge's layout
  std::vector<FluxVaeFileTensor> files;
  bool conv = false;  // a convolution weight: [O, K, K, I] here, [O, I, K, K] in the files

  // The shape of file tensor `rows` rows of this parameter has in diffusers' layout.
  Shape file_shape(int64_t rows) const;
};

std::vector<FluxVaeParamSpec> flux_vae_parameter_specs(const FluxVaeConfig& config);

class FluxVaeParameters {
 public:
  // Every parameter zero, fp32 on the CPU or bf16 (or fp32) on CUDA.
  explicit FluxVaeParameters(const FluxVaeConfig& config, Device device = Device::CPU, DType dtype = DType::F32);

  const FluxVaeConfig& config() const { return config_; }
  const std::vector<FluxVaeParamSpec>& specs() const { return specs_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  Device device() const { return flat_.device(); }
  DType dtype() const { return flat_.dtype(); }

  // The parameter named `name`; throws naming it when the model has none.
  const Tensor& get(const std::string& name) const;
  // Copies every value of `other` (the same model), converting device and dtype.
  void assign_from(const FluxVaeParameters& other);
  // Random weights for tests and debug runs, every tensor drawn from its own stream of the
  // seed: matrices N(0, 1 / fan_in), norm weights 1 + N(0, 0.04), biases N(0, 0.04).
  void initialize_random(uint64_t seed);

 private:
  FluxVaeConfig config_;
  std::vector<FluxVaeParamSpec> specs_;
  Tensor flat_;
  std::vector<Tensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace forge
