#include "model/nf4_base.h"

#include <algorithm>

#include "ops/elementwise.h"

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

// Everything but the base projections, in one buffer of the compute dtype; a projection's
// entry is an empty descriptor (Nf4BaseSource never reads it).
class Nf4FrozenBase::Rest : public ParamSource {
 public:
  Rest(const FlatParameters& host, Device device, DType dtype) {
    const std::vector<ParamSpec>& specs = host.specs();
    int64_t total = 0;
    for (const ParamSpec& spec : specs)
      if (!is_base_projection(spec)) total += shape_numel(spec.shape);
    flat_ = Tensor::empty({total}, dtype, device);
    layers_.resize(static_cast<size_t>(host.config().num_layers));
    int64_t offset = 0;
    for (size_t k = 0; k < specs.size(); ++k) {
      const ParamSpec& spec = specs[k];
      if (is_base_projection(spec)) {
        layers_.at(static_cast<size_t>(spec.layer)).params.emplace_back();
        continue;
      }
      const int64_t n = shape_numel(spec.shape);
      Tensor mine = flat_.narrow(offset, offset + n).view(spec.shape);
      offset += n;
      cast(mine, device == Device::CPU ? host.tensors()[k] : host.tensors()[k].to(device));
      if (spec.layer >= 0) layers_.at(static_cast<size_t>(spec.layer)).params.push_back({mine});
      else if (spec.name == "embedding.weight") embedding_ = mine;
      else if (spec.name == "final_norm.weight") final_norm_ = mine;
      else output_ = {mine};
    }
    if (host.config().tie_word_embeddings) output_ = {embedding_};
  }

  const Tensor& embedding() override { return embedding_; }
  const BlockWeights& layer(int index) override { return layers_.at(static_cast<size_t>(index)); }
  const Tensor& final_norm() override { return final_norm_; }
  const LinearWeight& output() override { return output_; }
  size_t nbytes() const { return flat_.nbytes(); }
  size_t layer_count() const { return layers_.size(); }

 private:
  Tensor flat_, embedding_, final_norm_;
  LinearWeight output_;
  std::vector<BlockWeights> layers_;
};

Nf4FrozenBase::Nf4FrozenBase(const FlatParameters& host, Device device, DType dtype)
    : specs_(host.specs()), codes_(quantize_base_nf4(host)) {
  if (device != Device::CPU) codes_ = codes_.to(device);
  rest_ = std::make_unique<Rest>(host, device, dtype);
  source_ = std::make_unique<Nf4BaseSource>(*rest_, specs_, codes_, device, dtype);
  scratch_bytes_ = static_cast<size_t>(nf4_scratch_bytes(host.config(), dtype));
}

Nf4FrozenBase::~Nf4FrozenBase() = default;

const Tensor& Nf4FrozenBase::embedding() { return rest_->embedding(); }
const BlockWeights& Nf4FrozenBase::layer(int index) { return source_->layer(index); }
const Tensor& Nf4FrozenBase::final_norm() { return rest_->final_norm(); }
const LinearWeight& Nf4FrozenBase::output() { return rest_->output(); }

size_t Nf4FrozenBase::nbytes() const { return codes_.nbytes() + rest_->nbytes() + scratch_bytes_; }

void Nf4FrozenBase::dequantize_into(FlatParameters& host) const {
  FORGE_CHECK(host.flat().device() == Device::CPU && host.flat().dtype() == DType::F32 && host.specs().size() == specs_.size(),
              "Nf4FrozenBase::dequantize_into: fp32 host parameters of the same model expected");
  Rest& rest = *rest_;
  std::vector<size_t> entry(rest.layer_count(), 0);  // the next entry of each block
  for (size_t k = 0; k < specs_.size(); ++k) {
    const Tensor& out = host.tensors()[k];
    const int layer = specs_[k].layer;
    if (layer >= 0) ++entry.at(static_cast<size_t>(layer));
    if (is_base_projection(specs_[k])) {
      const Nf4Weight& w = codes_.weights[k];
      nf4_dequantize(out, w.parts.front().device() == Device::CPU ? w : w.to(Device::CPU));
      continue;
    }
    Tensor value;
    if (layer >= 0) {
      value = rest.layer(layer).params.at(entry[static_cast<size_t>(layer)] - 1).weight;
    } else if (specs_[k].name == "embedding.weight") {
      value = rest.embedding();
    } else if (specs_[k].name == "final_norm.weight") {
      value = rest.final_norm();
    } else {
      value = rest.output().weight;
    }
    cast(out, value.device() == Device::CPU ? value : value.to(Device::CPU));
  }
}

}  // namespace forge
