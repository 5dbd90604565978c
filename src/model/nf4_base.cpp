#include "model/nf4_base.h"

#include <algorithm>

namespace forge {

bool is_base_projection(const ParamSpec& spec) { return spec.layer >= 0 && spec.shape.size() == 2; }

size_t Nf4Base::nbytes() const {
  size_t total = 0;
  for (const Nf4Weight& w : weights) total += w.nbytes();
  return total;
}

Nf4Base Nf4Base::to(Device device) const {
  Nf4Base moved;
  for (const Nf4Weight& w : weights) moved.weights.push_back(w.to(device));
  return moved;
}

double nf4_base_bytes(const ModelConfig& config) {
  double total = 0;
  for (const ParamSpec& spec : parameter_specs(config)) {
    if (!is_base_projection(spec)) continue;
    for (const HfTensor& part : spec.hf_tensors) total += static_cast<double>(nf4_bytes(part.rows * spec.shape[1]));
  }
  return total;
}

double nf4_scratch_bytes(const ModelConfig& config, DType compute_dtype) {
  int64_t largest = 0;
  for (const ParamSpec& spec : parameter_specs(config))
    if (is_base_projection(spec)) largest = std::max(largest, shape_numel(spec.shape));
  return static_cast<double>(largest) * static_cast<double>(dtype_size(compute_dtype));
}

Nf4Base quantize_base_nf4(const FlatParameters& params) {
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "quantize_base_nf4: the parameters must be fp32 on the CPU (as imported), got {} on {}",
              dtype_name(params.flat().dtype()), device_name(params.flat().device()));
  const std::vector<ParamSpec>& specs = params.specs();
  Nf4Base base;
  base.weights.resize(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    if (!is_base_projection(specs[k])) continue;
    const Tensor& tensor = params.tensors()[k];
    int64_t row = 0;
    for (const HfTensor& part : specs[k].hf_tensors) {
      base.weights[k].parts.push_back(nf4_quantize(tensor.narrow(row, row + part.rows)));
      row += part.rows;
    }
    FORGE_CHECK(row == specs[k].shape[0], "quantize_base_nf4: {}'s Hugging Face tensors cover {} of its {} rows",
                specs[k].name, row, specs[k].shape[0]);
  }
  return base;
}

Nf4BaseSource::Nf4BaseSource(ParamSource& rest, const std::vector<ParamSpec>& specs, const Nf4Base& base,
                             Device device, DType dtype)
    : rest_(rest), base_(base) {
  FORGE_CHECK(base.weights.size() == specs.size(), "Nf4BaseSource: {} NF4 entries for {} parameters",
              base.weights.size(), specs.size());
  int64_t largest = 0;
  for (size_t k = 0; k < specs.size(); ++k) {
    if (specs[k].layer < 0) continue;
    const auto layer = static_cast<size_t>(specs[k].layer);
    if (layer_specs_.size() <= layer) layer_specs_.resize(layer + 1);
    layer_specs_[layer].push_back(k);
    if (!is_base_projection(specs[k])) continue;
    FORGE_CHECK(base.quantized(k), "Nf4BaseSource: {} has no NF4 codes", specs[k].name);
    FORGE_CHECK(base.weights[k].shape() == specs[k].shape, "Nf4BaseSource: {}'s codes are {}, expected {}",
                specs[k].name, shape_str(base.weights[k].shape()), shape_str(specs[k].shape));
    FORGE_CHECK(base.weights[k].parts.front().device() == device, "Nf4BaseSource: {}'s codes are on {}, expected {}",
                specs[k].name, device_name(base.weights[k].parts.front().device()), device_name(device));
    largest = std::max(largest, shape_numel(specs[k].shape));
  }
  scratch_ = Tensor::empty({largest}, dtype, device);
  layers_.resize(layer_specs_.size());
  for (size_t layer = 0; layer < layer_specs_.size(); ++layer) {
    for (size_t spec : layer_specs_[layer]) {
      LinearWeight entry;
      if (is_base_projection(specs[spec])) {
        entry.weight = scratch_.narrow(0, shape_numel(specs[spec].shape)).view(specs[spec].shape);
        entry.nf4 = &base_.weights[spec];
      }
      layers_[layer].params.push_back(entry);
    }
  }
}

const BlockWeights& Nf4BaseSource::layer(int index) {
  const BlockWeights& source = rest_.layer(index);
  BlockWeights& mine = layers_.at(static_cast<size_t>(index));
  FORGE_CHECK(source.params.size() == mine.params.size(), "Nf4BaseSource: block {} has {} parameters, expected {}",
              index, source.params.size(), mine.params.size());
  for (size_t k = 0; k < mine.params.size(); ++k)
    if (!mine.params[k].nf4) mine.params[k] = source.params[k];  // norms: the source's own tensors
  return mine;
}

}  // namespace forge
