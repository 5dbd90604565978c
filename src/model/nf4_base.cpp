#include "model/nf4_base.h"

// NOTE [FP8 over an NF4 base]
// QLoRA with precision.fp8 (tensorwise or delayed): the trainer wraps the Nf4FrozenBase in
// frozen Fp8Projections (NOTE [FP8 frozen base] in model/fp8_projections.h) and those in the
// LoraAdapters, so a base projection's descriptor carries `nf4`, `fp8` and `lora` at once.
// linear_forward and linear_backward_input(_add) dequantize its codes into the shared
// scratch as for a bf16 GEMM (nf4_dequantize: bf16 on CUDA), and the FP8 op then takes
// that scratch as its W: an amax pass over those bf16 values (tensorwise; delayed folds the
// amax into the cast), E4M3 codes (transposed for the input gradient) in the FP8
// workspace, the FP8 GEMM; the adapters add their share in bf16. So the amax is exactly
// that of the values cast, and every code is the one LoRA with FP8 over a bf16 base holding
// the dequantized weights would cast (the CPU tests check it bitwise). The backward's
// reuse of W's forward statistics (NOTE [FP8 forward statistics] in ops/fp8_linear.h) keys
// on the weight's address, which every projection's scratch shares; the statistics are the
// projection's own, though, and its backward dequantizes the same codes into the same
// values again, so the reused amax is the one this W has.
// Memory stays QLoRA's: per GEMM one transient bf16 copy of the projection (the scratch
// QLoRA has anyway) and its FP8 codes in the workspace (two code buffers, of the largest
// of tokens × in, tokens × out and out × in, which the memory estimate counts as FP8
// scratch). The FP8 weight cache is not used (fp8_settings_of): holding every weight's W
// and W^T codes is 2 bytes per weight, four times the NF4 codes, most of what NF4 saves.
// The price is time: each base GEMM adds an amax and a cast pass over its bf16 W to the
// dequantization QLoRA already runs. On CUDA the linear ops skip the bf16 round trip: the
// codes come straight from the NF4 codes, bitwise the same (NOTE [FP8 straight from NF4] in
// ops/nf4_fp8.h); the CPU reference keeps the steps above.
// It runs wherever QLoRA runs: one device; data parallelism, whose ranks hold replicas of
// the base (NOTE [LoRA under data parallelism] in model/lora.h) and cast them alike, the
// delayed amaxes reduced at the step's end (NOTE [FP8 under data parallelism] in
// train/trainer_fp8.cpp); context and pipeline parallelism (a pipeline rank's projections
// of its stages alone, NOTE [FP8 under context and pipeline parallelism]) and tensor
// parallelism (a rank's shards, NOTE [NF4 base under tensor parallelism] in model/nf4_base.h).
// Mixture-of-Experts and MLA models: NOTE [FP8 over NF4 expert stacks].
//
// NOTE [FP8 over NF4 expert stacks]
// On a Mixture-of-Experts model QLoRA's routed experts are NF4 stacks (NOTE [NF4 expert
// stacks] in model/nf4_base.h) that Nf4BaseSource::layer(i) dequantizes, block i's whole
// stacks at once, into the expert scratch every block shares; the descriptor it hands out
// for a stack is a plain weight over that scratch. Fp8Projections wraps it as it wraps a
// bf16 base's stack under LoRA (NOTE [FP8 frozen routed experts] in ops/moe_fp8.h): the
// stack's FP8 settings with its Fp8ExpertStack (NOTE [FP8 expert stack state]), so
// moe_experts_forward_fp8 / moe_experts_backward_fp8 cast each expert's slice of the
// dequantized bf16 stack to E4M3 with that expert's own amax (tensorwise) or delayed scale,
// run its forward and input-gradient GEMMs in FP8 and no weight gradient, and the experts'
// adapters (NOTE [LoRA on routed experts] in ops/lora_experts.h) add their share in the
// compute dtype. The router stays in the compute dtype, as under LoRA. Every expert's codes
// are then the ones LoRA with FP8 over a bf16 base holding the dequantized stacks casts (the
// CPU tests check training bitwise). What makes it right although every block's stacks
// share one scratch:
//  - the decoder asks for block i just before its forward and again before its backward
//    (and recomputation), so the stacks are dequantized again, to the same values, before
//    every use: the backward's reuse of an expert's forward statistics (NOTE [FP8 forward
//    statistics] in ops/fp8_linear.h; the slots are block i's stack's own, in its
//    Fp8ExpertStack) reads the scales of the very values it casts again;
//  - no weight cache (fp8_settings_of turns it off under QLoRA, NOTE [FP8 over an NF4
//    base]): holding every expert's codes would cost 2 bytes per weight, four times the NF4
//    codes, most of what NF4 saves on a model whose weights are mostly experts. So every
//    GEMM casts its expert's slice of the scratch again, as every dense NF4 projection's.
// Multi-head Latent Attention's projections (q or q_a and q_b, kv_a, kv_b, o) are 2-D NF4
// projections like a dense block's (their rows in the published order, NOTE [NF4 stored row
// order] in ops/nf4.h), dequantized per GEMM as above; kv_a's two row views
// (LatentAttention::rows) dequantize the whole projection into the scratch and view its
// rows, and both take kv_a's FP8 settings (NOTE [FP8 latent attention] in
// model/latent_attention.h). Under expert parallelism a rank's NF4 base holds its local
// experts' stacks alone (NOTE [NF4 expert stacks under expert parallelism]) and its
// Fp8ExpertStacks are sized by them, the statistics blocks numbered from its first local
// expert (NOTE [FP8 routed experts under expert parallelism] in ops/moe_fp8.h), so a rank
// casts exactly its experts' dequantized slices, on the rows its group sent them; under
// pipelining a rank's stages' blocks alone. The memory is QLoRA's plus LoRA FP8's scratch
// (the experts' row codes and statistics; no cache).

#include <algorithm>
#include <cstdint>
#include <string>

#include "ops/elementwise.h"

namespace forge {

bool is_router(const ParamSpec& spec) { return spec.name.ends_with("moe.router.weight"); }

bool is_base_projection(const ParamSpec& spec) {
  return spec.layer >= 0 && spec.shape.size() == 2 && !is_router(spec);
}

bool is_quantized_expert_stack(const ParamSpec& spec) { return spec.layer >= 0 && spec.expert_stack; }

bool is_quantized_base_weight(const ParamSpec& spec) {
  return is_base_projection(spec) || is_quantized_expert_stack(spec);
}

Shape nf4_matrix_shape(const ParamSpec& spec) {
  if (spec.shape.size() == 2) return spec.shape;
  return {spec.shape[0] * spec.shape[1], spec.shape[2]};  // [E, R, C]: the experts' rows stacked
}

namespace {

// One NF4 tensor per Hugging Face weight the projection (or the stack of experts' matrices)
// is made of.
Nf4Weight quantize_projection(const ParamSpec& spec, const Tensor& values) {
  const Tensor matrix = values.view(nf4_matrix_shape(spec));
  Nf4Weight w;
  int64_t row = 0;
  for (const HfTensor& part : spec.hf_tensors) {
    w.parts.push_back(nf4_quantize(matrix.narrow(row, row + part.rows)));
    row += part.rows;
  }
  FORGE_CHECK(row == matrix.dim(0), "quantize_base_nf4: {}'s Hugging Face tensors cover {} of its {} rows", spec.name,
              row, matrix.dim(0));
  return w;
}

// NOTE [NF4 stored row order]: the weight's rows taken in stored_rows' order, quantized,
// with row_order (each row's stored row) to gather them back at every dequantization.
Nf4Weight quantize_in_stored_order(const ParamSpec& spec, const Tensor& values, std::span<const int64_t> stored_rows) {
  const Shape matrix = nf4_matrix_shape(spec);
  FORGE_CHECK(static_cast<int64_t>(stored_rows.size()) == matrix[0],
              "Nf4FrozenBase::set: {} has {} rows, {} stored rows given", spec.name, matrix[0], stored_rows.size());
  Tensor stored = Tensor::empty(matrix);
  Tensor order = Tensor::empty({matrix[0]}, DType::I32);
  std::vector<char> seen(static_cast<size_t>(matrix[0]), 0);
  const float* from = values.data<float>();
  for (int64_t r = 0; r < matrix[0]; ++r) {
    const int64_t row = stored_rows[static_cast<size_t>(r)];
    FORGE_CHECK(row >= 0 && row < matrix[0] && !seen[static_cast<size_t>(row)],
                "Nf4FrozenBase::set: {}'s stored rows are not a permutation of its {} rows", spec.name, matrix[0]);
    seen[static_cast<size_t>(row)] = 1;
    std::copy_n(from + row * matrix[1], matrix[1], stored.data<float>() + r * matrix[1]);
    order.data<int32_t>()[row] = static_cast<int32_t>(r);
  }
  Nf4Weight w = quantize_projection(spec, stored.view(spec.shape));
  w.row_order = order;
  return w;
}

}  // namespace

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

double nf4_base_bytes(const ModelConfig& config, const std::vector<ParamSpec>& specs) {
  double total = 0;
  for (const ParamSpec& spec : specs.empty() ? parameter_specs(config) : specs) {
    if (!is_quantized_base_weight(spec)) continue;
    const int64_t columns = nf4_matrix_shape(spec)[1];
    for (const HfTensor& part : spec.hf_tensors) total += static_cast<double>(nf4_bytes(part.rows * columns));
  }
  return total;
}

namespace {

// The largest projection, and the experts' stacks of one block (its whole dequantized set).
std::pair<int64_t, int64_t> scratch_elements(const std::vector<ParamSpec>& specs) {
  int64_t largest = 0;
  std::vector<int64_t> experts;
  for (const ParamSpec& spec : specs) {
    if (is_base_projection(spec)) largest = std::max(largest, shape_numel(spec.shape));
    if (!is_quantized_expert_stack(spec)) continue;
    const auto layer = static_cast<size_t>(spec.layer);
    if (experts.size() <= layer) experts.resize(layer + 1, 0);
    experts[layer] += shape_numel(spec.shape);
  }
  return {largest, experts.empty() ? 0 : *std::max_element(experts.begin(), experts.end())};
}

}  // namespace

double nf4_scratch_bytes(const ModelConfig& config, DType compute_dtype, bool stored_row_order,
                         const std::vector<ParamSpec>& held) {
  const std::vector<ParamSpec> specs = held.empty() ? parameter_specs(config) : held;
  const auto [projection, experts] = scratch_elements(specs);
  int64_t staging = 0;  // NOTE [NF4 stored row order]: the largest projection with rotary rows
  if (stored_row_order)
    for (const ParamSpec& spec : specs)
      for (const HfTensor& part : spec.hf_tensors)
        if (is_base_projection(spec) && part.rotary_rows.period > 0) staging = std::max(staging, shape_numel(spec.shape));
  return static_cast<double>(projection + experts + staging) * static_cast<double>(dtype_size(compute_dtype));
}

void check_nf4_tensor_parallel(const ModelConfig& config, int64_t degree) {
  if (degree == 1) return;
  const int64_t block = 64;  // cpu::kNf4BlockSize (NOTE [NF4 storage])
  for (const ParamSpec& spec : parameter_specs(config, {0, static_cast<int>(degree)})) {
    if (!is_quantized_base_weight(spec) || spec.layer != 0) continue;  // every block's shapes are block 0's
    const bool attention = spec.name.find("attention") != std::string::npos;
    if (spec.tensor_parallel == TensorParallelSplit::Columns && spec.shape[1] % block != 0)
      FORGE_FAIL("QLoRA under tensor parallelism over {} ranks: each rank quantizes its {} columns of {} to NF4, "
                 "which must be a multiple of NF4's block of {} (so that its blocks are blocks of the whole "
                 "tensor: NOTE [NF4 base under tensor parallelism]); {} {} / {} = {}",
                 degree, spec.shape[1], spec.name, block,
                 attention ? "model.num_heads x head dim" : "model.ffn_hidden_size", spec.shape[1] * degree, degree,
                 spec.shape[1]);
    if (spec.tensor_parallel != TensorParallelSplit::Rows) continue;
    for (const HfTensor& part : spec.hf_tensors)
      if (part.rows * spec.shape[1] % block != 0)
        FORGE_FAIL("QLoRA under tensor parallelism over {} ranks: each rank quantizes its {} rows of {} ({} x "
                   "model.hidden_size {} values) to NF4, which must be a multiple of NF4's block of {} (so that its "
                   "blocks are blocks of the whole tensor: NOTE [NF4 base under tensor parallelism])",
                   degree, part.rows, part.name, part.rows, spec.shape[1], block);
  }
}

Nf4Base quantize_base_nf4(const FlatParameters& params) {
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "quantize_base_nf4: the parameters must be fp32 on the CPU (as imported), got {} on {}",
              dtype_name(params.flat().dtype()), device_name(params.flat().device()));
  const std::vector<ParamSpec>& specs = params.specs();
  Nf4Base base;
  base.weights.resize(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    if (is_quantized_base_weight(specs[k])) base.weights[k] = quantize_projection(specs[k], params.tensors()[k]);
  }
  return base;
}

Nf4BaseSource::Nf4BaseSource(ParamSource& rest, const std::vector<ParamSpec>& specs, const Nf4Base& base,
                             Device device, DType dtype)
    : rest_(rest), base_(base) {
  FORGE_CHECK(base.weights.size() == specs.size(), "Nf4BaseSource: {} NF4 entries for {} parameters",
              base.weights.size(), specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    if (specs[k].layer < 0) continue;
    const auto layer = static_cast<size_t>(specs[k].layer);
    if (layer_specs_.size() <= layer) layer_specs_.resize(layer + 1);
    layer_specs_[layer].push_back(k);
    if (!is_quantized_base_weight(specs[k])) continue;
    FORGE_CHECK(base.quantized(k), "Nf4BaseSource: {} has no NF4 codes", specs[k].name);
    FORGE_CHECK(base.weights[k].shape() == nf4_matrix_shape(specs[k]), "Nf4BaseSource: {}'s codes are {}, expected {}",
                specs[k].name, shape_str(base.weights[k].shape()), shape_str(nf4_matrix_shape(specs[k])));
    FORGE_CHECK(base.weights[k].parts.front().device() == device, "Nf4BaseSource: {}'s codes are on {}, expected {}",
                specs[k].name, device_name(base.weights[k].parts.front().device()), device_name(device));
  }
  const auto [projection, experts] = scratch_elements(specs);
  scratch_ = Tensor::empty({projection}, dtype, device);
  expert_scratch_ = Tensor::empty({experts}, dtype, device);
  layers_.resize(layer_specs_.size());
  expert_stacks_.resize(layer_specs_.size());
  for (size_t layer = 0; layer < layer_specs_.size(); ++layer) {
    int64_t offset = 0;  // in expert_scratch_
    for (size_t spec : layer_specs_[layer]) {
      LinearWeight entry;
      const int64_t n = shape_numel(specs[spec].shape);
      if (is_base_projection(specs[spec])) {
        entry.weight = scratch_.narrow(0, n).view(specs[spec].shape);
        entry.nf4 = &base_.weights[spec];
      } else if (is_quantized_expert_stack(specs[spec])) {
        entry.weight = expert_scratch_.narrow(offset, offset + n).view(specs[spec].shape);
        offset += n;
        expert_stacks_[layer].push_back({layers_[layer].params.size(), spec});
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
  const std::vector<std::pair<size_t, size_t>>& stacks = expert_stacks_.at(static_cast<size_t>(index));
  auto stacked = [&](size_t k) {
    return std::any_of(stacks.begin(), stacks.end(), [&](const auto& entry) { return entry.first == k; });
  };
  for (size_t k = 0; k < mine.params.size(); ++k)
    if (!mine.params[k].nf4 && !stacked(k)) mine.params[k] = source.params[k];  // norms, router: the source's own
  // NOTE [NF4 expert stacks]: this block's experts, whole, into the scratch they share.
  for (const auto& [entry, spec] : stacks) {
    const Tensor& out = mine.params[entry].weight;
    nf4_dequantize(out.view(base_.weights[spec].shape()), base_.weights[spec]);
  }
  return mine;
}

// Everything but the base projections, in one buffer of the compute dtype; a projection's
// entry is an empty descriptor (Nf4BaseSource never reads it).
class Nf4FrozenBase::Rest : public ParamSource {
 public:
  Rest(const ModelConfig& config, const std::vector<ParamSpec>& specs, Device device, DType dtype) {
    int64_t total = 0;
    for (const ParamSpec& spec : specs)
      if (!is_quantized_base_weight(spec)) total += shape_numel(spec.shape);
    flat_ = Tensor::zeros({total}, dtype, device);
    views_.resize(specs.size());
    layers_.resize(static_cast<size_t>(config.num_layers));
    int64_t offset = 0;
    for (size_t k = 0; k < specs.size(); ++k) {
      const ParamSpec& spec = specs[k];
      if (is_quantized_base_weight(spec)) {
        layers_.at(static_cast<size_t>(spec.layer)).params.emplace_back();
        continue;
      }
      const int64_t n = shape_numel(spec.shape);
      views_[k] = flat_.narrow(offset, offset + n).view(spec.shape);
      offset += n;
      if (spec.layer >= 0) layers_.at(static_cast<size_t>(spec.layer)).params.push_back({views_[k]});
      else if (spec.name == "embedding.weight") embedding_ = views_[k];
      else if (spec.name == "final_norm.weight") final_norm_ = views_[k];
      else output_ = {views_[k]};
    }
    if (config.tie_word_embeddings) output_ = {embedding_};
  }

  const Tensor& embedding() override { return embedding_; }
  const BlockWeights& layer(int index) override { return layers_.at(static_cast<size_t>(index)); }
  const Tensor& final_norm() override { return final_norm_; }
  const LinearWeight& output() override { return output_; }
  size_t nbytes() const { return flat_.nbytes(); }
  const Tensor& view(size_t spec) const { return views_.at(spec); }

 private:
  Tensor flat_, embedding_, final_norm_;
  std::vector<Tensor> views_;  // per spec; undefined for a base projection
  LinearWeight output_;
  std::vector<BlockWeights> layers_;
};

Nf4FrozenBase::Nf4FrozenBase(const ModelConfig& config, Device device, DType dtype,
                             const std::vector<PipelineStage>& stages, ExpertShard experts, TensorParallelShard shard)
    : config_(config),
      specs_(expert_parallel_specs(pipeline_stage_specs(parameter_specs(config, shard), stages), experts)),
      experts_(experts),
      shard_(shard),
      device_(device),
      dtype_(dtype) {
  FORGE_CHECK(experts.size == 1 || shard.size == 1,
              "Nf4FrozenBase: expert parallelism ({} ranks) under tensor parallelism is not built", experts.size);
  if (shard.size > 1) check_nf4_tensor_parallel(config, shard.size);  // NOTE [NF4 base under tensor parallelism]
  codes_.weights.resize(specs_.size());
  filled_.assign(specs_.size(), 0);
  rest_ = std::make_unique<Rest>(config, specs_, device, dtype);
}

Nf4FrozenBase::Nf4FrozenBase(const FlatParameters& host, Device device, DType dtype,
                             const std::function<std::vector<int64_t>(size_t spec)>& stored_rows, ExpertShard experts)
    : Nf4FrozenBase(host.config(), device, dtype, {}, experts) {
  for (size_t k = 0; k < specs_.size(); ++k) set(k, host.tensors()[k], stored_rows ? stored_rows(k) : std::vector<int64_t>{});
  finish();
}

void Nf4FrozenBase::set(size_t spec, const Tensor& given, std::span<const int64_t> stored_rows) {
  FORGE_CHECK(!source_, "Nf4FrozenBase::set after finish()");
  const ParamSpec& s = specs_.at(spec);
  // NOTE [NF4 expert stacks under expert parallelism]: the local experts of the whole stack.
  const bool sliced = s.expert_stack && experts_.size > 1;
  Shape whole = s.shape;
  if (sliced) whole[0] *= experts_.size;
  const bool local = given.shape() == s.shape;
  FORGE_CHECK(given.device() == Device::CPU && given.dtype() == DType::F32 && (local || given.shape() == whole),
              "Nf4FrozenBase::set: {} expects fp32 host values of shape {}, got {} {} on {}", s.name,
              shape_str(s.shape), dtype_name(given.dtype()), shape_str(given.shape()), device_name(given.device()));
  FORGE_CHECK(!sliced || stored_rows.empty(),
              "Nf4FrozenBase::set: {} is an expert stack, whose rows are stored in order", s.name);
  const Tensor values = local ? given : given.narrow(experts_.index * s.shape[0], (experts_.index + 1) * s.shape[0]);
  if (is_quantized_base_weight(s)) {
    Nf4Weight w = stored_rows.empty() ? quantize_projection(s, values) : quantize_in_stored_order(s, values, stored_rows);
    codes_.weights[spec] = device_ == Device::CPU ? std::move(w) : w.to(device_);
  } else {
    cast(rest_->view(spec), device_ == Device::CPU ? values : values.to(device_));
  }
  filled_[spec] = 1;
}

void Nf4FrozenBase::finish() {
  for (size_t k = 0; k < specs_.size(); ++k)
    FORGE_CHECK(filled_[k], "Nf4FrozenBase: {} was never set", specs_[k].name);
  int64_t reordered = 0;  // NOTE [NF4 stored row order]: one staging buffer for them all
  for (const Nf4Weight& w : codes_.weights)
    if (w.row_order.defined()) reordered = std::max(reordered, shape_numel(w.shape()));
  staging_ = reordered > 0 ? Tensor::empty({reordered}, dtype_, device_) : Tensor();
  for (Nf4Weight& w : codes_.weights)
    if (w.row_order.defined()) w.staging = staging_.narrow(0, shape_numel(w.shape())).view(w.shape());
  source_ = std::make_unique<Nf4BaseSource>(*rest_, specs_, codes_, device_, dtype_);
  scratch_bytes_ = static_cast<size_t>(nf4_scratch_bytes(config_, dtype_, false, specs_)) +
                   (staging_.defined() ? staging_.nbytes() : 0);
}

void Nf4FrozenBase::initialize(uint64_t seed) {
  for (size_t k = 0; k < specs_.size(); ++k) {
    Tensor values = Tensor::empty(specs_[k].shape, DType::F32, Device::CPU);
    // A sliced expert stack's values are the whole stack's from its first local expert on.
    const int64_t begin = specs_[k].expert_stack ? experts_.index * values.numel() : 0;
    // Under tensor parallelism the shard's values of the whole parameter's initialization.
    initialize_parameter_ranges(config_, specs_, seed, {{k, begin, values.numel(), values.data<float>()}}, shard_);
    set(k, values);
  }
  finish();
}

Nf4FrozenBase::~Nf4FrozenBase() = default;

const Tensor& Nf4FrozenBase::embedding() { return rest_->embedding(); }
const BlockWeights& Nf4FrozenBase::layer(int index) {
  FORGE_CHECK(source_, "Nf4FrozenBase: read before finish()");
  return source_->layer(index);
}
const Tensor& Nf4FrozenBase::final_norm() { return rest_->final_norm(); }
const LinearWeight& Nf4FrozenBase::output() { return rest_->output(); }

size_t Nf4FrozenBase::nbytes() const { return codes_.nbytes() + rest_->nbytes() + scratch_bytes_; }

void Nf4FrozenBase::dequantize_into(FlatParameters& host) const {
  FORGE_CHECK(host.flat().device() == Device::CPU && host.flat().dtype() == DType::F32 &&
                  host.specs().size() == specs_.size(),
              "Nf4FrozenBase::dequantize_into: fp32 host parameters of the same model expected");
  for (size_t k = 0; k < specs_.size(); ++k) {
    const Tensor& whole = host.tensors()[k];
    const int64_t held = specs_[k].shape[0];  // NOTE [NF4 expert stacks under expert parallelism]
    dequantize(k, specs_[k].expert_stack && whole.shape() != specs_[k].shape
                      ? whole.narrow(experts_.index * held, (experts_.index + 1) * held)
                      : whole);
  }
}

void Nf4FrozenBase::dequantize(size_t spec, const Tensor& out) const {
  FORGE_CHECK(out.device() == Device::CPU && out.dtype() == DType::F32 && out.shape() == specs_.at(spec).shape,
              "Nf4FrozenBase::dequantize: {} into {} {} on {}, fp32 host values of shape {} expected",
              specs_[spec].name, dtype_name(out.dtype()), shape_str(out.shape()), device_name(out.device()),
              shape_str(specs_[spec].shape));
  if (is_quantized_base_weight(specs_[spec])) {
    const Nf4Weight& w = codes_.weights[spec];
    nf4_dequantize(out.view(w.shape()), w.parts.front().device() == Device::CPU ? w : w.to(Device::CPU));
  } else {
    const Tensor& value = rest_->view(spec);
    cast(out, value.device() == Device::CPU ? value : value.to(Device::CPU));
  }
}

}  // namespace forge
