#include "model/fp8_projections.h"

#include <algorithm>
#include <utility>

namespace forge {

namespace {

// [out, in] of every matrix trained in FP8 (NOTE [FP8 projections]).
std::vector<std::pair<int64_t, int64_t>> fp8_matrices(const ModelConfig& config, const Fp8Settings& settings) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const ParamSpec& spec : parameter_specs(config))
    if (spec.layer >= 0 && spec.shape.size() == 2) out.emplace_back(spec.shape[0], spec.shape[1]);
  if (settings.output_head) out.emplace_back(config.vocab_size, config.hidden_size);
  return out;
}

}  // namespace

int64_t fp8_workspace_codes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens) {
  int64_t most = 0;
  for (const auto& [out, in] : fp8_matrices(config, settings))
    most = std::max({most, tokens * in, tokens * out, out * in});
  return most;
}

int64_t fp8_gemm_params(const ModelConfig& config, const Fp8Settings& settings) {
  int64_t params = 0;
  for (const auto& [out, in] : fp8_matrices(config, settings)) params += out * in;
  return params;
}

int64_t fp8_scratch_bytes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens) {
  // The shared statistics, and each layer parameter's (and the FP8 head's) forward statistics.
  int64_t layer_params = 0;
  for (const ParamSpec& spec : parameter_specs(config)) layer_params += spec.layer >= 0 ? 1 : 0;
  const int64_t stats = 1 + layer_params + (settings.output_head ? 1 : 0);
  return 3 * fp8_workspace_codes(config, settings, tokens) +
         stats * kFp8WorkspaceStats * static_cast<int64_t>(sizeof(float));
}

Fp8Projections::Fp8Projections(const ModelConfig& config, const Fp8Settings& settings, Device device, int64_t tokens)
    : config_(config), settings_(settings), device_(device) {
  if (device == Device::CUDA) {
    const int64_t codes = fp8_workspace_codes(config, settings, tokens);
    workspace_.a_codes = Tensor::empty({codes}, DType::U8, device);
    workspace_.b_codes = Tensor::empty({codes}, DType::U8, device);
    workspace_.c_codes = Tensor::empty({codes}, DType::U8, device);
    workspace_.stats = Tensor::zeros({kFp8WorkspaceStats}, DType::F32, device);
  }
  fp8_.grad_format = settings.grad_format;
  fp8_.workspace = &workspace_;
  layers_.resize(static_cast<size_t>(config.num_layers));
  grad_layers_.resize(static_cast<size_t>(config.num_layers));
  layer_projections_.resize(static_cast<size_t>(config.num_layers));
  head_projections_.resize(1);
}

Fp8Projections::Projections& Fp8Projections::projections(std::vector<Projections>& all, size_t index,
                                                           size_t params) {
  Projections& p = all.at(index);
  if (p.linears.size() == params) return p;
  FORGE_CHECK(p.linears.empty(), "FP8 projections: layer {} has {} parameters, earlier {}", index, params,
              p.linears.size());
  p.forward.resize(params);
  p.linears.assign(params, fp8_);
  if (device_ == Device::CUDA) {
    p.stats = Tensor::zeros({static_cast<int64_t>(params) * kFp8WorkspaceStats}, DType::F32, device_);
    for (size_t k = 0; k < params; ++k) {
      p.forward[k].device = p.stats.data<float>() + static_cast<int64_t>(k) * kFp8WorkspaceStats;
      p.linears[k].forward = &p.forward[k];
    }
  }
  return p;
}

void Fp8Projections::set_base(ParamSource& weights, GradSink& gradients) {
  weights_ = &weights;
  gradients_ = &gradients;
}

ParamSource& Fp8Projections::weights() const {
  FORGE_CHECK(weights_, "FP8 projections used before set_base");
  return *weights_;
}

GradSink& Fp8Projections::gradients() const {
  FORGE_CHECK(gradients_, "FP8 projections used before set_base");
  return *gradients_;
}

const BlockWeights& Fp8Projections::with_fp8(const BlockWeights& base, int index, std::vector<BlockWeights>& out) {
  BlockWeights& block = out.at(static_cast<size_t>(index));
  block = base;
  Projections& p = projections(layer_projections_, static_cast<size_t>(index), block.params.size());
  for (size_t k = 0; k < block.params.size(); ++k)
    if (block.params[k].weight.ndim() == 2) block.params[k].fp8 = &p.linears[k];
  return block;
}

const LinearWeight& Fp8Projections::head(const LinearWeight& base, LinearWeight& out) {
  if (!settings_.output_head) return base;
  out = base;
  out.fp8 = &projections(head_projections_, 0, 1).linears[0];
  return out;
}

const BlockWeights& Fp8Projections::layer(int index) { return with_fp8(weights().layer(index), index, layers_); }

const BlockWeights& Fp8Projections::layer_grads(int index) {
  return with_fp8(gradients().layer_grads(index), index, grad_layers_);
}

const LinearWeight& Fp8Projections::output() { return head(weights().output(), output_); }

const LinearWeight& Fp8Projections::output_grad() { return head(gradients().output_grad(), output_grad_); }

}  // namespace forge
