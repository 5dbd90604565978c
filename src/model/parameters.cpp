#include "model/parameters.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"
#include "core/rng.h"
#include "model/block_components.h"
#include "model/expert_shard.h"
#include "model/tensor_parallel.h"
#include "ops/elementwise.h"

namespace forge {

std::vector<ParamSpec> parameter_specs(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  std::vector<ParamSpec> specs;
  specs.push_back({"embedding.weight", {c.vocab_size, h}, {{"model.embed_tokens.weight", c.vocab_size}}, true, -1});
  specs.back().tensor_parallel = TensorParallelSplit::Rows;
  const BlockComponents components = make_block_components(c);
  for (int i = 0; i < c.num_layers; ++i)
    for (const auto& component : components)
      for (ParamSpec& spec : component->param_specs(i)) specs.push_back(std::move(spec));
  specs.push_back({"final_norm.weight", {h}, {{"model.norm.weight", h}}, false, -1});
  if (!c.tie_word_embeddings)
    specs.push_back({"output.weight", {c.vocab_size, h}, {{"lm_head.weight", c.vocab_size}}, true, -1});
  if (!c.tie_word_embeddings) specs.back().tensor_parallel = TensorParallelSplit::Rows;
  return specs;
}

ParamSpec tensor_parallel_spec(const ParamSpec& full, TensorParallelShard shard) {
  FORGE_CHECK(shard.size >= 1 && shard.rank >= 0 && shard.rank < shard.size, "tensor-parallel rank {} of {}",
              shard.rank, shard.size);
  ParamSpec spec = full;
  const int64_t t = shard.size;
  switch (full.tensor_parallel) {
    case TensorParallelSplit::Replicated: return spec;
    case TensorParallelSplit::Rows:
      FORGE_CHECK(full.shape.size() == 2, "'{}' {}: a row-split parameter is a matrix", full.name,
                  shape_str(full.shape));
      for (HfTensor& hf : spec.hf_tensors) {
        FORGE_CHECK(hf.rows % t == 0,
                    "tensor parallelism over {} ranks splits the rows of '{}' ({} rows of '{}'), which it does not "
                    "divide",
                    t, full.name, hf.rows, hf.name);
        hf.rows /= t;
      }
      spec.shape[0] /= t;
      return spec;
    case TensorParallelSplit::Columns:
      FORGE_CHECK(full.shape.size() == 2 && full.shape[1] % t == 0,
                  "tensor parallelism over {} ranks splits the columns of '{}' {}, which it does not divide", t,
                  full.name, shape_str(full.shape));
      spec.shape[1] /= t;
      return spec;
  }
  FORGE_FAIL("'{}': unknown tensor-parallel split", full.name);
}

ParamSpec expert_parallel_spec(const ParamSpec& whole, ExpertShard shard) {
  FORGE_CHECK(shard.size >= 1 && shard.index >= 0 && shard.index < shard.size, "expert-parallel rank {} of {}",
              shard.index, shard.size);
  if (!whole.expert_stack || shard.size == 1) return whole;
  const int64_t experts = whole.shape.at(0), parts = static_cast<int64_t>(whole.hf_tensors.size());
  FORGE_CHECK(experts % shard.size == 0 && parts % experts == 0,
              "expert parallelism over {} ranks splits '{}' {} ({} Hugging Face tensors) by experts, which it does not "
              "divide",
              shard.size, whole.name, shape_str(whole.shape), parts);
  const int64_t held = experts / shard.size, per_expert = parts / experts;
  ParamSpec spec = whole;
  spec.shape[0] = held;
  const auto first = whole.hf_tensors.begin() + shard.index * held * per_expert;
  spec.hf_tensors.assign(first, first + held * per_expert);
  return spec;
}

std::vector<ParamSpec> expert_parallel_specs(std::vector<ParamSpec> specs, ExpertShard shard) {
  for (ParamSpec& spec : specs) spec = expert_parallel_spec(spec, shard);
  return specs;
}

std::vector<ParamSpec> parameter_specs(const ModelConfig& config, TensorParallelShard shard) {
  std::vector<ParamSpec> specs = parameter_specs(config);
  if (shard.size == 1) return specs;
  check_tensor_parallel(config, shard.size);
  for (ParamSpec& spec : specs) spec = tensor_parallel_spec(spec, shard);
  return specs;
}

std::vector<ShardRun> tensor_parallel_runs(const ParamSpec& full, TensorParallelShard shard) {
  const ParamSpec local = tensor_parallel_spec(full, shard);
  const int64_t t = shard.size, r = shard.rank;
  std::vector<ShardRun> runs;
  switch (full.tensor_parallel) {
    case TensorParallelSplit::Replicated: runs.push_back({0, 0, shape_numel(full.shape)}); break;
    case TensorParallelSplit::Rows: {
      const int64_t cols = full.shape[1];
      int64_t full_row = 0, local_row = 0;
      for (const HfTensor& hf : full.hf_tensors) {
        const int64_t rows = hf.rows / t;
        runs.push_back({local_row * cols, (full_row + r * rows) * cols, rows * cols});
        full_row += hf.rows;
        local_row += rows;
      }
      break;
    }
    case TensorParallelSplit::Columns: {
      const int64_t rows = full.shape[0], cols = full.shape[1], width = local.shape[1];
      for (int64_t i = 0; i < rows; ++i) runs.push_back({i * width, i * cols + r * width, width});
      break;
    }
  }
  return runs;
}

ComponentWeights::ComponentWeights(const BlockWeights& block, size_t first, size_t count)
    : block_(&block), first_(first), count_(count) {
  FORGE_CHECK(first + count <= block.params.size(), "component parameters [{}, {}) of a block of {}", first,
              first + count, block.params.size());
}

const LinearWeight& ComponentWeights::at(size_t k) const {
  FORGE_CHECK(k < count_, "component parameter {} of {}", k, count_);
  return block_->params[first_ + k];
}

std::vector<ParamSpec> pipeline_stage_specs(std::vector<ParamSpec> specs, const std::vector<PipelineStage>& stages) {
  if (stages.empty()) return specs;
  auto held = [&](const ParamSpec& spec) {
    for (const PipelineStage& s : stages) {
      if (spec.layer >= 0 ? spec.layer >= s.first_layer && (s.end_layer < 0 || spec.layer < s.end_layer)
                          : (spec.name == "embedding.weight" ? s.embedding : s.head))
        return true;
    }
    return false;
  };
  std::erase_if(specs, [&](const ParamSpec& spec) { return !held(spec); });
  return specs;
}

FlatParameters::FlatParameters(const ModelConfig& config, Device device, DType dtype, TensorParallelShard shard,
                               std::vector<PipelineStage> stages)
    : config_(config),
      shard_(shard),
      stages_(std::move(stages)),
      specs_(pipeline_stage_specs(parameter_specs(config, shard), stages_)) {
  int64_t total = 0;
  for (const auto& s : specs_) total += shape_numel(s.shape);
  flat_ = Tensor::zeros({total}, dtype, device);
  int64_t offset = 0;
  for (const auto& s : specs_) {
    int64_t n = shape_numel(s.shape);
    tensors_.push_back(flat_.narrow(offset, offset + n).view(s.shape));
    offset += n;
  }
  weights_.layers.resize(static_cast<size_t>(config.num_layers));
  for (size_t k = 0; k < specs_.size(); ++k) {
    const ParamSpec& spec = specs_[k];
    if (spec.layer >= 0) weights_.layers[static_cast<size_t>(spec.layer)].params.push_back({tensors_[k]});
    else if (spec.name == "embedding.weight") weights_.embedding = tensors_[k];
    else if (spec.name == "final_norm.weight") weights_.final_norm = tensors_[k];
    else if (spec.name == "output.weight") weights_.output = {tensors_[k]};
    else FORGE_FAIL("parameter '{}' belongs to no block and is not the embedding, final norm or output", spec.name);
  }
  if (config.tie_word_embeddings) weights_.output = {weights_.embedding};
  layers_fresh_.assign(static_cast<size_t>(config.num_layers), 0);
}

const Tensor& FlatParameters::find(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return tensors_[i];
  FORGE_FAIL("no parameter named '{}' in model '{}'", name, config_.name);
}

void FlatParameters::discard() {
  std::fill(layers_fresh_.begin(), layers_fresh_.end(), 1);
  head_fresh_ = embedding_fresh_ = true;
}

void FlatParameters::layer_done(int index) { layers_fresh_.at(static_cast<size_t>(index)) = 0; }

void FlatParameters::head_done() {
  head_fresh_ = false;
  if (config_.tie_word_embeddings) embedding_fresh_ = false;  // the head wrote the embedding's gradient
}

void FlatParameters::assign_from(const FlatParameters& other) {
  FORGE_CHECK(other.flat_.numel() == flat_.numel(), "assign_from: {} values into {}", other.flat_.numel(),
              flat_.numel());
  if (other.flat_.device() == flat_.device()) {
    cast(flat_, other.flat_);
    return;
  }
  // Across devices a piece at a time: the whole source never exists a second time on the
  // destination. (A frozen bf16 LoRA base of Llama 3.1 8B, initialized as fp32 on the host,
  // used to be staged whole on the GPU first: 32 GB beside the 16 GB it was cast into.)
  constexpr int64_t kPiece = int64_t{1} << 26;  // 64 Mi values, 256 MiB in fp32
  const int64_t n = flat_.numel();
  for (int64_t begin = 0; begin < n; begin += kPiece) {
    const int64_t count = std::min(kPiece, n - begin);
    cast(flat_.narrow(begin, begin + count), other.flat_.narrow(begin, begin + count).to(flat_.device()));
  }
}

void initialize_parameter(const ModelConfig& config, const ParamSpec& s, uint64_t seed, float* p, int64_t begin,
                          int64_t count) {
  if (count < 0) count = shape_numel(s.shape) - begin;
  if (s.shape.size() == 1) {
    for (int64_t j = 0; j < count; ++j) p[j] = s.zero_init ? 0.0f : 1.0f;
    return;
  }
  const double residual_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(config.num_layers));
  double std = config.init_std * (s.residual_projection ? residual_scale : 1.0);
  uint64_t name_hash = 1469598103934665603ull;
  for (char ch : s.name) name_hash = (name_hash ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
  Rng rng(derive_seed(seed, name_hash));
  // SplitMix64 is a counter: each normal() takes two steps, so value `begin` starts
  // 2 * begin steps in.
  rng.set_state(rng.state() + 2 * static_cast<uint64_t>(begin) * Rng::kIncrement);
  for (int64_t j = 0; j < count; ++j) p[j] = static_cast<float>(std * rng.normal());
}

void FlatParameters::initialize(uint64_t seed) {
  if (flat_.device() != Device::CPU || flat_.dtype() != DType::F32) {
    FlatParameters host(config_, Device::CPU, DType::F32, shard_, stages_);
    host.initialize(seed);
    assign_from(host);
    return;
  }
  std::vector<ParameterRange> ranges;
  for (size_t i = 0; i < specs_.size(); ++i) ranges.push_back({i, 0, tensors_[i].numel(), tensors_[i].data<float>()});
  initialize_parameter_ranges(config_, specs_, seed, ranges, shard_);
}

void initialize_parameter_ranges(const ModelConfig& config, const std::vector<ParamSpec>& specs, uint64_t seed,
                                 const std::vector<ParameterRange>& ranges, TensorParallelShard shard) {
  if (shard.size > 1) {
    // NOTE [Tensor-parallel shards]: each range, cut where the shard's runs are, as ranges of
    // the whole parameters (a pipeline rank's: the specs of its stages, by name).
    std::vector<ParamSpec> full;
    for (const ParamSpec& spec : parameter_specs(config))
      if (std::any_of(specs.begin(), specs.end(), [&](const ParamSpec& s) { return s.name == spec.name; }))
        full.push_back(spec);
    FORGE_CHECK(full.size() == specs.size(), "{} shard specs for a model of {} parameters", specs.size(),
                full.size());
    for (size_t i = 0; i < full.size(); ++i)
      FORGE_CHECK(full[i].name == specs[i].name, "shard spec {} is '{}', the model's '{}'", i, specs[i].name,
                  full[i].name);
    std::vector<ParameterRange> whole;
    for (const ParameterRange& range : ranges)
      for (const ShardRun& run : tensor_parallel_runs(full[range.spec], shard)) {
        const int64_t begin = std::max(range.begin, run.local_begin);
        const int64_t end = std::min(range.begin + range.count, run.local_begin + run.count);
        if (begin < end)
          whole.push_back({range.spec, run.full_begin + (begin - run.local_begin), end - begin,
                           range.out + (begin - range.begin)});
      }
    return initialize_parameter_ranges(config, full, seed, whole);
  }
  // Every value is a function of (seed, name, index): pieces of 1M values fill in
  // parallel with the same result.
  constexpr int64_t kPiece = 1 << 20;
  std::vector<std::pair<size_t, int64_t>> pieces;  // (range, first value within it)
  for (size_t r = 0; r < ranges.size(); ++r)
    for (int64_t b = 0; b < ranges[r].count; b += kPiece) pieces.push_back({r, b});
  parallel_for(static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const auto [r, first] = pieces[static_cast<size_t>(k)];
      const ParameterRange& range = ranges[r];
      initialize_parameter(config, specs[range.spec], seed, range.out + first, range.begin + first,
                           std::min(kPiece, range.count - first));
    }
  });
}

}  // namespace forge
