// FLUX's parameter specs and their flat holder; see flux_parameters.h.
#include "model/flux_parameters.h"

#include <algorithm>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "ops/elementwise.h"

namespace forge {
namespace {

struct Specs {
  std::vector<ParamSpec> specs;
  std::vector<FluxTensorInit> inits;  // torchtitan's, one per spec
};

// Appends the specs of one unit (ParamSpec::layer = unit).
class UnitSpecs {
 public:
  UnitSpecs(std::vector<ParamSpec>& specs, std::vector<FluxTensorInit>& inits, int unit)
      : specs_(specs), inits_(inits), unit_(unit) {}

  // A projection [out, in] with its bias [out], stacked from diffusers tensors `parts`
  // (each `out / parts.size()` rows); no parts: the diffusers tensor of the same name.
  // `init` is its weight's torchtitan initialization (NOTE [FLUX weight init]).
  void linear(const std::string& name, int64_t out, int64_t in, FluxTensorInit init,
              const std::vector<std::string>& parts = {}) {
    ParamSpec weight;
    weight.name = name + ".weight";
    weight.shape = {out, in};
    ParamSpec bias;
    bias.name = name + ".bias";
    bias.shape = {out};
    bias.weight_decay = false;
    bias.zero_init = true;
    if (parts.empty()) {
      weight.hf_tensors = {{weight.name, out}};
      bias.hf_tensors = {{bias.name, out}};
    } else {
      const int64_t rows = out / static_cast<int64_t>(parts.size());
      for (const std::string& part : parts) {
        weight.hf_tensors.push_back({part + ".weight", rows});
        bias.hf_tensors.push_back({part + ".bias", rows});
      }
    }
    add(std::move(weight), init);
    add(std::move(bias), {FluxTensorInit::Kind::Constant, 0.0});
  }
  // A norm scale [size], starting at 1.
  void vector(const std::string& name, int64_t size) {
    ParamSpec spec;
    spec.name = name;
    spec.shape = {size};
    spec.hf_tensors = {{name, size}};
    spec.weight_decay = false;
    add(std::move(spec), {FluxTensorInit::Kind::Constant, 1.0});
  }

 private:
  void add(ParamSpec spec, FluxTensorInit init) {
    spec.layer = unit_;
    specs_.push_back(std::move(spec));
    inits_.push_back(init);
  }
  std::vector<ParamSpec>& specs_;
  std::vector<FluxTensorInit>& inits_;
  int unit_;
};

// NOTE [FLUX weight init]'s three rules for a weight.
FluxTensorInit zeros() { return {FluxTensorInit::Kind::Constant, 0.0}; }
FluxTensorInit normal(double std) { return {FluxTensorInit::Kind::Normal, std}; }
// Xavier (Glorot) uniform for a torchtitan Linear of out x in: U(-b, b), b = sqrt(6 / (in + out)).
FluxTensorInit xavier(int64_t out, int64_t in) {
  return {FluxTensorInit::Kind::Uniform, std::sqrt(6.0 / static_cast<double>(in + out))};
}

// Units in kind order (flux_unit): the embedders, the streams of a double block, a single
// block, the head.
void embedder_specs(const FluxConfig& c, Specs& s) {
  UnitSpecs u(s.specs, s.inits, 0);
  const int64_t d = c.hidden();
  constexpr double kEmbedderStd = 0.02;  // torchtitan's MLPEmbedder.init_weights(init_std=0.02)
  u.linear("x_embedder", d, c.in_channels, xavier(d, c.in_channels));
  u.linear("context_embedder", d, c.context_dim, xavier(d, c.context_dim));
  u.linear("time_text_embed.timestep_embedder.linear_1", d, c.timestep_dim, normal(kEmbedderStd));
  u.linear("time_text_embed.timestep_embedder.linear_2", d, d, normal(kEmbedderStd));
  u.linear("time_text_embed.text_embedder.linear_1", d, c.pooled_dim, normal(kEmbedderStd));
  u.linear("time_text_embed.text_embedder.linear_2", d, d, normal(kEmbedderStd));
  if (c.guidance_embeds) {
    u.linear("time_text_embed.guidance_embedder.linear_1", d, c.timestep_dim, normal(kEmbedderStd));
    u.linear("time_text_embed.guidance_embedder.linear_2", d, d, normal(kEmbedderStd));
  }
}

void double_block_specs(const FluxConfig& c, int block, Specs& s) {
  const std::string p = fmt::format("transformer_blocks.{}.", block);
  const int64_t d = c.hidden(), m = c.mlp_hidden();
  // Linears of both streams first (image, then text), then their norm scales, so that the
  // unit's numbering is flux_unit's.
  UnitSpecs u(s.specs, s.inits, flux_double_unit(block));
  u.linear(p + "norm1.linear", 6 * d, d, zeros());
  u.linear(p + "attn.to_qkv", 3 * d, d, xavier(3 * d, d), {p + "attn.to_q", p + "attn.to_k", p + "attn.to_v"});
  u.linear(p + "attn.to_out.0", d, d, xavier(d, d));
  u.linear(p + "ff.net.0.proj", m, d, xavier(m, d));
  u.linear(p + "ff.net.2", d, m, xavier(d, m));
  u.linear(p + "norm1_context.linear", 6 * d, d, zeros());
  u.linear(p + "attn.to_added_qkv", 3 * d, d, xavier(3 * d, d),
           {p + "attn.add_q_proj", p + "attn.add_k_proj", p + "attn.add_v_proj"});
  u.linear(p + "attn.to_add_out", d, d, xavier(d, d));
  u.linear(p + "ff_context.net.0.proj", m, d, xavier(m, d));
  u.linear(p + "ff_context.net.2", d, m, xavier(d, m));
  u.vector(p + "attn.norm_q.weight", c.head_dim);
  u.vector(p + "attn.norm_k.weight", c.head_dim);
  u.vector(p + "attn.norm_added_q.weight", c.head_dim);
  u.vector(p + "attn.norm_added_k.weight", c.head_dim);
}

void single_block_specs(const FluxConfig& c, int block, Specs& s) {
  const std::string p = fmt::format("single_transformer_blocks.{}.", block);
  const int64_t d = c.hidden(), m = c.mlp_hidden();
  UnitSpecs u(s.specs, s.inits, flux_single_unit(c, block));
  // torchtitan's linear1 is q, k, v and the MLP's input in one [3d + m, d] Linear: both
  // pieces take its Xavier bound.
  u.linear(p + "norm.linear", 3 * d, d, zeros());
  u.linear(p + "attn.to_qkv", 3 * d, d, xavier(3 * d + m, d), {p + "attn.to_q", p + "attn.to_k", p + "attn.to_v"});
  u.linear(p + "proj_mlp", m, d, xavier(3 * d + m, d));
  u.linear(p + "proj_out", d, d + m, xavier(d, d + m));
  u.vector(p + "attn.norm_q.weight", c.head_dim);
  u.vector(p + "attn.norm_k.weight", c.head_dim);
}

void head_specs(const FluxConfig& c, Specs& s) {
  UnitSpecs u(s.specs, s.inits, flux_head_unit(c));
  u.linear("norm_out.linear", 2 * c.hidden(), c.hidden(), zeros());
  u.linear("proj_out", c.resolved_out_channels(), c.hidden(), zeros());
}

Specs all_specs(const FluxConfig& config) {
  config.validate(config.name);
  Specs s;
  embedder_specs(config, s);
  for (int i = 0; i < config.num_double_blocks; ++i) double_block_specs(config, i, s);
  for (int i = 0; i < config.num_single_blocks; ++i) single_block_specs(config, i, s);
  head_specs(config, s);
  return s;
}

// Offsets of the tensors in the flat buffer: each starts on a multiple of 64 values, so
// every GEMM operand and vector is aligned for vectorized and cuBLASLt access.
constexpr int64_t kAlignValues = 64;
int64_t aligned(int64_t n) { return (n + kAlignValues - 1) / kAlignValues * kAlignValues; }

}  // namespace

std::vector<ParamSpec> flux_parameter_specs(const FluxConfig& config) { return all_specs(config).specs; }

std::vector<FluxTensorInit> flux_torchtitan_inits(const FluxConfig& config) { return all_specs(config).inits; }

FluxWeightInit parse_flux_weight_init(std::string_view name, std::string_view what) {
  if (name == "normal") return FluxWeightInit::Normal;
  if (name == "torchtitan") return FluxWeightInit::Torchtitan;
  FORGE_FAIL("{} '{}': expected normal or torchtitan", what, name);
}

FluxParameters::FluxParameters(const FluxConfig& config, Device device, DType dtype, float init_std)
    : config_(config), init_std_(init_std), specs_(flux_parameter_specs(config)) {
  // NOTE [FLUX parameter regions]: the weight-decayed tensors first, then the others.
  int64_t total = 0;
  std::vector<int64_t> offsets(specs_.size());
  for (bool decayed : {true, false}) {
    if (!decayed) decayed_values_ = total;
    for (size_t i = 0; i < specs_.size(); ++i)
      if (specs_[i].weight_decay == decayed) {
        offsets[i] = total;
        total += aligned(shape_numel(specs_[i].shape));
      }
  }
  flat_ = Tensor::zeros({total}, dtype, device);
  const size_t units = static_cast<size_t>(flux_num_units(config_));
  std::vector<std::vector<const ParamSpec*>> unit_specs(units);
  std::vector<std::vector<Tensor>> unit_tensors(units);
  for (size_t i = 0; i < specs_.size(); ++i) {
    const ParamSpec& s = specs_[i];
    const int64_t n = shape_numel(s.shape);
    tensors_.push_back(flat_.narrow(offsets[i], offsets[i] + n).view(s.shape));
    unit_specs.at(static_cast<size_t>(s.layer)).push_back(&s);
    unit_tensors.at(static_cast<size_t>(s.layer)).push_back(tensors_.back());
  }
  for (size_t u = 0; u < units; ++u) units_.push_back(flux_unit_weights(unit_specs[u], unit_tensors[u]));
}

FluxUnitWeights flux_unit_weights(const std::vector<const ParamSpec*>& specs, const std::vector<Tensor>& tensors) {
  FORGE_CHECK(specs.size() == tensors.size(), "flux_unit_weights: {} tensors for {} parameters", tensors.size(),
              specs.size());
  FluxUnitWeights unit;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = *specs[i];
    if (s.shape.size() == 2)
      unit.linears.emplace_back().weight = tensors[i];
    else if (i > 0 && specs[i - 1]->shape.size() == 2 && s.name.ends_with(".bias"))
      unit.linears.back().bias = tensors[i];
    else
      unit.vectors.push_back(tensors[i]);
  }
  return unit;
}

void FluxParameters::assign_from(const FluxParameters& other) {
  FORGE_CHECK(other.flat_.numel() == flat_.numel(), "assign_from: {} values into {}", other.flat_.numel(),
              flat_.numel());
  if (other.flat_.device() == flat_.device())
    cast(flat_, other.flat_);
  else
    cast(flat_, other.flat_.to(flat_.device()));
}

// NOTE [FLUX initialization in parallel]
// Every tensor draws from its own stream (the seed and its name), so tensors can be drawn
// at once on several threads: num_threads() tensors at a time, each into its own host
// buffer, handed to `each` in spec order. The values are those of drawing them one by one;
// FLUX.1-dev's 11.9 B normals take seconds instead of minutes. Host memory is
// num_threads() buffers of the largest tensor's (151 MB for FLUX.1-dev's MLP weights).
void initialize_flux_tensors(const FluxConfig& config, uint64_t seed, FluxWeightInit init, float init_std,
                             const std::function<void(size_t, std::span<const float>)>& each) {
  const std::vector<ParamSpec> specs = flux_parameter_specs(config);
  const std::vector<FluxTensorInit> torchtitan =
      init == FluxWeightInit::Torchtitan ? flux_torchtitan_inits(config) : std::vector<FluxTensorInit>{};
  auto draw = [&](size_t i, std::vector<float>& values) {
    const ParamSpec& s = specs[i];
    FluxTensorInit rule = torchtitan.empty() ? FluxTensorInit{FluxTensorInit::Kind::Normal, init_std} : torchtitan[i];
    if (torchtitan.empty() && s.shape.size() == 1) rule = {FluxTensorInit::Kind::Constant, s.zero_init ? 0.0 : 1.0};
    const int64_t n = shape_numel(s.shape);
    values.resize(static_cast<size_t>(n));
    float* p = values.data();
    if (rule.kind == FluxTensorInit::Kind::Constant) {
      for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>(rule.value);
    } else {
      uint64_t name_hash = 1469598103934665603ull;
      for (char ch : s.name) name_hash = (name_hash ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
      Rng rng(derive_seed(seed, name_hash));
      if (rule.kind == FluxTensorInit::Kind::Normal)
        for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>(rule.value * rng.normal());
      else
        for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>(rule.value * (2.0 * rng.uniform() - 1.0));
    }
  };
  const size_t at_once = static_cast<size_t>(std::max(1, num_threads()));
  std::vector<std::vector<float>> buffers(std::min(at_once, specs.size()));
  for (size_t first = 0; first < specs.size(); first += at_once) {
    const size_t count = std::min(at_once, specs.size() - first);
    parallel_for(static_cast<int64_t>(count), 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) draw(first + static_cast<size_t>(k), buffers[static_cast<size_t>(k)]);
    });
    for (size_t k = 0; k < count; ++k) each(first + k, std::span<const float>(buffers[k].data(), buffers[k].size()));
  }
}

void FluxParameters::initialize(uint64_t seed, FluxWeightInit init) {
  // A tensor at a time: a GPU or bf16 buffer takes each tensor's values through the host
  // buffer of one tensor (never the whole model in fp32 on the host or the device).
  initialize_flux_tensors(config_, seed, init, init_std_, [&](size_t i, std::span<const float> values) {
    const Tensor& dst = tensors_[i];
    if (dst.device() == Device::CPU && dst.dtype() == DType::F32) {
      std::copy(values.begin(), values.end(), dst.data<float>());
      return;
    }
    const Tensor src = Tensor::wrap(const_cast<float*>(values.data()), dst.shape(), DType::F32);
    cast(dst, dst.device() == Device::CPU ? src : src.to(dst.device()));
  });
}

}  // namespace forge
