#include "model/fp8_projections.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <utility>

#include "core/comma_list.h"
#include "core/error.h"
#include "ops/moe.h"
#include "ops/fp8_statistics.h"

namespace forge {

namespace {

// A matrix trained in FP8 (NOTE [FP8 projections]): [out, in], and whether it is one
// routed expert's (NOTE [FP8 routed experts] in ops/moe_fp8.h).
struct Fp8Matrix {
  int64_t out, in;
  bool expert;
};

std::vector<Fp8Matrix> fp8_matrices(const ModelConfig& config, const Fp8Settings& settings) {
  std::vector<Fp8Matrix> out;
  for (const ParamSpec& spec : parameter_specs(config)) {
    if (fp8_block_projection(spec, settings)) out.push_back({spec.shape[0], spec.shape[1], false});
    if (fp8_expert_stack(spec, settings))
      for (int64_t e = 0; e < spec.shape[0]; ++e) out.push_back({spec.shape[1], spec.shape[2], true});
  }
  if (settings.output_head) out.push_back({config.vocab_size, config.hidden_size, false});
  return out;
}

// The most rows one routed expert receives in a micro-batch of `tokens` tokens (each token
// chooses distinct experts; with padding to capacity every expert has the capacity; under
// expert parallelism from each of the group's `ranks`), rounded up to a multiple of 16
// (NOTE [FP8 padded token contraction] in ops/fp8_linear.h).
int64_t expert_rows(const ModelConfig& config, int64_t tokens, int64_t ranks) {
  const MoeCapacity capacity{config.moe_capacity_factor, config.moe_token_drop_policy == "position",
                             config.moe_pad_to_capacity};
  const int64_t most = ranks * std::max(tokens, capacity.pad ? capacity.capacity(tokens, config.num_experts_per_tok,
                                                                                   config.num_experts)
                                                             : int64_t{0});
  return (most + kFp8TokenMultiple - 1) / kFp8TokenMultiple * kFp8TokenMultiple;
}

// NOTE [FP8 under tensor parallelism]: the roles whose tensor differs between the ranks of
// a tensor-parallel group for a weight split so: the weight's own always; a
// column-parallel (or vocabulary-parallel) projection's output gradient (its columns), a
// row-parallel projection's input (its columns). The others are gathered, the same on
// every rank.
uint8_t sharded_roles(TensorParallelSplit split) {
  using cpu::Fp8Role;
  switch (split) {
    case TensorParallelSplit::Rows: return fp8_role_bit(Fp8Role::W) | fp8_role_bit(Fp8Role::Dy);
    case TensorParallelSplit::Columns: return fp8_role_bit(Fp8Role::W) | fp8_role_bit(Fp8Role::X);
    case TensorParallelSplit::Replicated: return 0;
  }
  return 0;
}

}  // namespace

bool fp8_filtered(const std::string& name, const Fp8Settings& settings) {
  return std::any_of(settings.filter_fqns.begin(), settings.filter_fqns.end(),
                     [&](const std::string& f) { return name.find(f) != std::string::npos; });
}

std::vector<std::string> fp8_filter_fqns_of(const std::string& text) {
  if (trim_blanks(text).empty()) return {};
  return split_comma_list(text);
}

std::vector<ParamSpec> fp8_filter_candidates(const ModelConfig& config, const Fp8Settings& settings) {
  Fp8Settings unfiltered = settings;
  unfiltered.filter_fqns.clear();
  std::vector<ParamSpec> candidates;
  for (const ParamSpec& spec : parameter_specs(config))
    if (fp8_block_projection(spec, unfiltered) || fp8_expert_stack(spec, unfiltered)) candidates.push_back(spec);
  return candidates;
}

std::string describe_fp8_filter(const ModelConfig& config, const Fp8Settings& settings) {
  const std::vector<ParamSpec> candidates = fp8_filter_candidates(config, settings);
  std::vector<std::string> kept;
  for (const ParamSpec& spec : candidates)
    if (fp8_filtered(spec.name, settings)) kept.push_back(spec.name);
  constexpr size_t kNamed = 6;
  const size_t named = std::min(kept.size(), kNamed);
  return fmt::format("precision.fp8_filter_fqns '{}' keeps {} of the {} block projections{} in the compute dtype: {}{}",
                     fmt::join(settings.filter_fqns, ","), kept.size(), candidates.size(),
                     config.moe() && settings.routed_experts ? " and routed-expert stacks" : "",
                     fmt::join(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(named), ", "),
                     kept.size() > named ? fmt::format(" and {} more", kept.size() - named) : "");
}

std::vector<std::string> fp8_projection_names(const ModelConfig& config, const Fp8Settings& settings) {
  std::vector<std::string> names;
  std::string head = "embedding.weight";  // tied
  for (const ParamSpec& spec : parameter_specs(config)) {
    if (spec.name == "output.weight") head = spec.name;
    if (fp8_block_projection(spec, settings)) names.push_back(spec.name);
    if (fp8_expert_stack(spec, settings))  // NOTE [FP8 routed experts]: a block per expert, in expert order
      for (int64_t e = 0; e < spec.shape[0]; ++e) names.push_back(fmt::format("{} (expert {})", spec.name, e));
  }
  if (settings.output_head) names.push_back(head);
  return names;
}

int64_t fp8_workspace_codes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens) {
  int64_t most = 0;
  for (const auto& [out, in, expert] : fp8_matrices(config, settings)) {
    const int64_t rows = expert ? expert_rows(config, tokens, settings.expert_parallel) : tokens;
    most = std::max({most, rows * in, rows * out, out * in});
  }
  return most;
}

int64_t fp8_gemm_params(const ModelConfig& config, const Fp8Settings& settings) {
  int64_t params = 0, expert_params = 0;
  for (const auto& [out, in, expert] : fp8_matrices(config, settings)) (expert ? expert_params : params) += out * in;
  // A token runs through k of the E experts.
  if (expert_params > 0) params += expert_params / config.num_experts * config.num_experts_per_tok;
  return params;
}

int64_t fp8_projection_count(const ModelConfig& config, const Fp8Settings& settings) {
  return static_cast<int64_t>(fp8_matrices(config, settings).size());
}

int64_t fp8_weight_cache_bytes(const ModelConfig& config, const Fp8Settings& settings) {
  if (!settings.weight_cache) return 0;
  int64_t cached = 0, experts = 0;
  for (const auto& [out, in, expert] : fp8_matrices(config, settings)) (expert ? experts : cached) += out * in;
  // NOTE [FP8 expert stack state]: a rank caches its local experts alone.
  return 2 * (cached + experts / std::max<int64_t>(settings.expert_parallel, 1));
}

int64_t fp8_expert_row_codes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens) {
  int64_t widest = 0;
  for (const auto& [out, in, expert] : fp8_matrices(config, settings))
    if (expert) widest = std::max(widest, in);
  if (widest == 0) return 0;
  const MoeCapacity capacity{config.moe_capacity_factor, config.moe_token_drop_policy == "position",
                             config.moe_pad_to_capacity};
  const int64_t k = config.num_experts_per_tok, experts = config.num_experts;
  const int64_t rows = std::max(tokens * k, capacity.pad ? experts * capacity.capacity(tokens, k, experts) : int64_t{0});
  // A rank's local experts receive up to every expert-parallel rank's rows, each expert's
  // codes from a 256-byte boundary (kernels/cuda/fp8_grouped_layout.h).
  const int64_t ranks = std::max<int64_t>(settings.expert_parallel, 1);
  return cuda::fp8_grouped_codes_bytes(ranks * rows, widest, experts / ranks);
}

int64_t fp8_scratch_bytes(const ModelConfig& config, const Fp8Settings& settings, int64_t tokens) {
  // The shared statistics, and each layer parameter's (and the FP8 head's) forward statistics.
  int64_t layer_params = 0;
  for (const ParamSpec& spec : parameter_specs(config)) layer_params += spec.layer >= 0 ? 1 : 0;
  const int64_t stats = 1 + layer_params + (settings.output_head ? 1 : 0);
  const int64_t projections = fp8_projection_count(config, settings);
  int64_t expert_matrices = 0;  // NOTE [FP8 expert stack state]: forward statistics per local expert
  for (const auto& m : fp8_matrices(config, settings)) expert_matrices += m.expert ? 1 : 0;
  const int64_t local_expert_matrices = expert_matrices / std::max<int64_t>(settings.expert_parallel, 1);
  const int64_t history =
      settings.recipe == Fp8Recipe::Delayed ? projections * cpu::kFp8Roles * settings.amax_history_length : 0;
  const int64_t nf4_stats = settings.frozen ? 3 * cpu::kFp8StatStride : 0;
  return (fp8_weight_gradients(settings) ? 3 : 2) * fp8_workspace_codes(config, settings, tokens) +
         fp8_expert_row_codes(config, settings, tokens) +
         ((stats + local_expert_matrices) * kFp8WorkspaceStats + projections * cpu::kFp8ProjectionStats + history +
          nf4_stats) *
             static_cast<int64_t>(sizeof(float));
}

Fp8Projections::Fp8Projections(const ModelConfig& config, const Fp8Settings& settings, Device device, int64_t tokens)
    : config_(config), settings_(settings), device_(device) {
  if (device == Device::CUDA) {
    const int64_t codes = fp8_workspace_codes(config, settings, tokens);
    workspace_.a_codes = Tensor::empty({codes}, DType::U8, device);
    workspace_.b_codes = Tensor::empty({codes}, DType::U8, device);
    if (fp8_weight_gradients(settings))  // dy^T for dW
      workspace_.c_codes = Tensor::empty({codes}, DType::U8, device);
    workspace_.stats = Tensor::zeros({kFp8WorkspaceStats}, DType::F32, device);
    // A frozen base may be NF4 (NOTE [FP8 straight from NF4] in ops/nf4_fp8.h).
    if (settings.frozen) workspace_.nf4_stats = Tensor::zeros({3 * cpu::kFp8StatStride}, DType::F32, device);
    if (const int64_t rows = fp8_expert_row_codes(config, settings, tokens); rows > 0)
      expert_row_codes_ = Tensor::empty({rows}, DType::U8, device);  // NOTE [FP8 grouped expert casts]
  }
  fp8_.grad_format = settings.grad_format;
  fp8_.weight_gradient = settings.weight_gradient;  // NOTE [FP8 weight gradient switch]
  fp8_.workspace = &workspace_;
  // Statistics blocks, numbered in parameter order (NOTE [FP8 projections]): their names as
  // fp8_projection_names gives them (a checkpoint's numbering is rebuilt from it), each
  // block's elements and sharded roles here.
  names_ = fp8_projection_names(config, settings);
  projection_of_.resize(static_cast<size_t>(config.num_layers));
  expert_stack_.resize(static_cast<size_t>(config.num_layers));
  TensorParallelSplit head_split = TensorParallelSplit::Replicated;
  for (const ParamSpec& spec : parameter_specs(config)) {
    if (spec.name == "output.weight" || (config.tie_word_embeddings && spec.name == "embedding.weight"))
      head_split = spec.tensor_parallel;
    if (spec.layer < 0) continue;
    std::vector<int64_t>& layer = projection_of_.at(static_cast<size_t>(spec.layer));
    const bool matrix = fp8_block_projection(spec, settings), experts = fp8_expert_stack(spec, settings);
    layer.push_back(matrix || experts ? static_cast<int64_t>(numels_.size()) : -1);
    expert_stack_.at(static_cast<size_t>(spec.layer)).push_back(experts);
    if (matrix) {
      numels_.push_back(spec.shape[0] * spec.shape[1]);
      sharded_roles_.push_back(sharded_roles(spec.tensor_parallel));
    }
    if (experts)  // NOTE [FP8 routed experts]: a block per expert, in expert order
      for (int64_t e = 0; e < spec.shape[0]; ++e) {
        numels_.push_back(spec.shape[1] * spec.shape[2]);
        sharded_roles_.push_back(0);
      }
  }
  if (settings.output_head) {
    numels_.push_back(config.vocab_size * config.hidden_size);
    sharded_roles_.push_back(sharded_roles(head_split));
  }
  const auto projections = static_cast<int64_t>(names_.size());
  stats_ = Tensor::empty({projections * cpu::kFp8ProjectionStats}, DType::F32, device);
  fp8_stats_init(stats_);
  if (settings.recipe == Fp8Recipe::Delayed) {
    FORGE_CHECK(settings.amax_history_length >= 1, "FP8 delayed scaling: the amax history length must be >= 1, got {}",
                settings.amax_history_length);
    history_ = Tensor::zeros({projections * cpu::kFp8Roles * settings.amax_history_length}, DType::F32, device);
  }
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
  p.caches.resize(params);
  p.produced.resize(params);
  p.experts.resize(params);
  p.linears.assign(params, fp8_);
  const bool head = &all == &head_projections_;
  for (size_t k = 0; k < params; ++k) {
    const int64_t block = head ? static_cast<int64_t>(names_.size()) - 1
                               : projection_of_.at(index).at(k);  // -1: not a matrix
    if (block < 0) continue;
    p.linears[k].stats = stats_.data<float>() + block * cpu::kFp8ProjectionStats;
    p.linears[k].delayed = delayed_active_;
    const uint8_t sharded = tensor_parallel_ ? sharded_roles_.at(static_cast<size_t>(block)) : uint8_t{0};
    if (tensor_parallel_) {  // NOTE [FP8 under tensor parallelism]
      p.linears[k].amax_group = tensor_parallel_;
      p.linears[k].amax_group_roles = sharded;
    }
    const bool experts = !head && expert_stack_.at(index).at(k);  // NOTE [FP8 expert stack state]: cached per expert
    if (device_ == Device::CUDA && settings_.weight_cache && !experts) {  // NOTE [FP8 weight cache]
      // Under tensor parallelism a split weight's shard (the degree divides every split).
      const int64_t numel = numels_.at(static_cast<size_t>(block)) / (sharded != 0 ? tensor_parallel_->size() : 1);
      p.caches[k].codes = Tensor::empty({numel}, DType::U8, device_);
      p.caches[k].codes_t = Tensor::empty({numel}, DType::U8, device_);
      p.caches[k].generation = &generation_;
      p.linears[k].weight_cache = cache_in_use(p.caches[k]);
    }
  }
  if (device_ == Device::CUDA) {
    p.stats = Tensor::zeros({static_cast<int64_t>(params) * kFp8WorkspaceStats}, DType::F32, device_);
    for (size_t k = 0; k < params; ++k) {
      p.forward[k].device = p.stats.data<float>() + static_cast<int64_t>(k) * kFp8WorkspaceStats;
      p.linears[k].forward = &p.forward[k];
      if (settings_.fused_producers) p.linears[k].produced = &p.produced[k];
    }
  }
  return p;
}

Fp8Projections::NonfiniteAmax Fp8Projections::first_nonfinite_amax() const {
  const int64_t slot = fp8_stats_first_nonfinite(stats_);
  return slot < 0 ? NonfiniteAmax{} : NonfiniteAmax{slot, fp8_stats_seen(stats_, slot)};
}

std::string Fp8Projections::describe(const NonfiniteAmax& found) const {
  FORGE_CHECK(found.slot >= 0 && found.slot < static_cast<int64_t>(names_.size()) * cpu::kFp8Roles,
              "FP8 projections: amax slot {} of {}", found.slot, names_.size() * cpu::kFp8Roles);
  const auto role = static_cast<cpu::Fp8Role>(found.slot % cpu::kFp8Roles);
  return fmt::format("'{}' {}: amax {}", names_.at(static_cast<size_t>(found.slot / cpu::kFp8Roles)),
                     cpu::fp8_role_name(role), found.amax);
}

int64_t Fp8Projections::projection_index(const std::string& name) const {
  const auto it = std::find(names_.begin(), names_.end(), name);
  return it == names_.end() ? -1 : static_cast<int64_t>(it - names_.begin());
}

std::string Fp8Projections::nonfinite_amax() const {
  const NonfiniteAmax found = first_nonfinite_amax();
  return found.slot < 0 ? "" : describe(found);
}

void Fp8Projections::discard_amaxes() { fp8_stats_clear_seen(stats_); }

Fp8WeightCache* Fp8Projections::cache_in_use(Fp8WeightCache& cache) const {
  if (!cache.codes.defined()) return nullptr;
  return caches_usable() ? &cache : nullptr;
}

bool Fp8Projections::caches_usable() const {
  // NOTE [FP8 frozen base]: a frozen W is cached with its delayed scale only.
  return !(settings_.frozen && settings_.recipe == Fp8Recipe::Delayed && !delayed_active_);
}

void Fp8Projections::end_step(bool update) {
  // NOTE [FP8 weight cache]: the optimizer may change every weight now (not a frozen one:
  // NOTE [FP8 frozen base]).
  if (!settings_.frozen) ++generation_;
  // NOTE [FP8 frozen routed experts]: a frozen expert's delayed W scale may still change
  // (one that received no rows yet), so under `delayed` the expert caches are cast again
  // after each update.
  if (!settings_.frozen || (settings_.recipe == Fp8Recipe::Delayed && update)) ++expert_generation_;
  if (settings_.recipe != Fp8Recipe::Delayed || !update) return fp8_stats_clear_seen(stats_);
  fp8_stats_delayed_step(stats_, history_,
                         {settings_.amax_history_length, settings_.amax_algorithm, settings_.margin,
                          settings_.grad_format});
  // A frozen base's W scales change once, when they come into use: weights cast with the
  // current scales before (FSDP's FP8 all-gather slots: NOTE [FP8 all-gather of a frozen
  // base] in distributed/fsdp.h) are cast again.
  if (settings_.frozen && !delayed_active_) ++generation_;
  set_delayed_active(true);
}

void Fp8Projections::set_delayed_active(bool active) {
  delayed_active_ = active;
  for (auto* all : {&layer_projections_, &head_projections_})
    for (Projections& p : *all)
      for (size_t k = 0; k < p.linears.size(); ++k)
        if (p.linears[k].stats) {
          p.linears[k].delayed = active;
          p.linears[k].weight_cache = cache_in_use(p.caches[k]);
          p.experts[k].cache_in_use = caches_usable();
        }
}

Fp8DelayedState Fp8Projections::delayed_state() const {
  Fp8DelayedState state;
  if (settings_.recipe != Fp8Recipe::Delayed) return state;
  state.active = delayed_active_;
  state.routed_experts = settings_.routed_experts;
  state.filter_fqns = settings_.filter_fqns;
  state.history_length = settings_.amax_history_length;
  const Tensor history = history_.to(Device::CPU), stats = stats_.to(Device::CPU);
  state.histories.assign(history.data<float>(), history.data<float>() + history.numel());
  const int64_t projections = static_cast<int64_t>(names_.size());
  for (int64_t p = 0; p < projections; ++p)
    for (int r = 0; r < cpu::kFp8Roles; ++r)
      state.scales.push_back(stats.data<float>()[cpu::fp8_scale_offset(p, static_cast<cpu::Fp8Role>(r))]);
  return state;
}

void Fp8Projections::restore_delayed_state(const Fp8DelayedState& saved) {
  FORGE_CHECK(settings_.recipe == Fp8Recipe::Delayed, "FP8: a delayed-scaling state given to a {} run", "tensorwise");
  const Fp8DelayedState state = saved_as_this_run(saved);
  const int64_t projections = static_cast<int64_t>(names_.size());
  FORGE_CHECK(state.history_length == settings_.amax_history_length,
              "FP8 delayed scaling: the checkpoint's amax history length is {}, precision.fp8_amax_history_len is {}",
              state.history_length, settings_.amax_history_length);
  FORGE_CHECK(static_cast<int64_t>(state.scales.size()) == projections * cpu::kFp8Roles &&
                  static_cast<int64_t>(state.histories.size()) == history_.numel(),
              "FP8 delayed scaling: the checkpoint holds {} scales and {} history values, this model needs {} and {}",
              state.scales.size(), state.histories.size(), projections * cpu::kFp8Roles, history_.numel());
  Tensor history = Tensor::empty({history_.numel()}, DType::F32, Device::CPU);
  std::copy(state.histories.begin(), state.histories.end(), history.data<float>());
  history_.copy_from(history);
  Tensor stats = Tensor::empty({stats_.numel()}, DType::F32, Device::CPU);
  cpu::fp8_init_stats(stats.data<float>(), projections);
  for (int64_t p = 0; p < projections; ++p)
    for (int r = 0; r < cpu::kFp8Roles; ++r) {
      const auto role = static_cast<cpu::Fp8Role>(r);
      const float scale = state.scales[static_cast<size_t>(p * cpu::kFp8Roles + r)];
      stats.data<float>()[cpu::fp8_scale_offset(p, role)] = scale;
      stats.data<float>()[cpu::fp8_scale_inv_offset(p, role)] = 1.0f / scale;
    }
  stats_.copy_from(stats);
  set_delayed_active(state.active);
  ++generation_;  // cached weight codes were cast with the old scales: NOTE [FP8 weight cache]
  ++expert_generation_;
}

Fp8DelayedState Fp8Projections::saved_as_this_run(const Fp8DelayedState& saved) const {
  // NOTE [FP8 routed experts switch], NOTE [FP8 filter]: the saved numbering is that of the
  // settings it was saved with; this run keeps each of its projections' blocks by name.
  Fp8Settings then = settings_;
  then.routed_experts = saved.routed_experts;
  then.filter_fqns = saved.filter_fqns;
  const std::vector<std::string> saved_names = fp8_projection_names(config_, then);
  Fp8DelayedState kept = saved;
  kept.routed_experts = settings_.routed_experts;
  kept.filter_fqns = settings_.filter_fqns;
  if (saved_names == names_) return kept;
  const int64_t length = saved.history_length;
  FORGE_CHECK(saved.scales.size() == saved_names.size() * cpu::kFp8Roles &&
                  static_cast<int64_t>(saved.histories.size()) == static_cast<int64_t>(saved.scales.size()) * length,
              "FP8 delayed scaling: the checkpoint holds {} scales and {} history values, this model under the FP8 "
              "layout it was saved with (precision.fp8_routed_experts {}, precision.fp8_filter_fqns '{}') needs {} and "
              "{}",
              saved.scales.size(), saved.histories.size(), saved.routed_experts, fmt::join(saved.filter_fqns, ","),
              saved_names.size() * cpu::kFp8Roles, static_cast<int64_t>(saved_names.size()) * cpu::kFp8Roles * length);
  kept.scales.clear();
  kept.histories.clear();
  for (const std::string& name : names_) {
    const auto at = std::find(saved_names.begin(), saved_names.end(), name);
    if (at == saved_names.end()) {
      if (!saved.routed_experts && name.ends_with(")"))
        FORGE_FAIL("the checkpoint was saved with precision.fp8_routed_experts false (its routed experts in the "
                   "compute dtype, with no amax histories) and this run sets it true: its experts would quantize "
                   "with no history and scale 1; resume with precision.fp8_routed_experts false");
      FORGE_FAIL("the checkpoint was saved with precision.fp8_filter_fqns '{}', which kept '{}' in the compute dtype "
                 "(no amax history), and this run trains it in FP8 (precision.fp8_filter_fqns '{}'): it would "
                 "quantize with no history and scale 1; resume with a filter that keeps it out of FP8 too",
                 fmt::join(saved.filter_fqns, ","), name, fmt::join(settings_.filter_fqns, ","));
    }
    const auto b = static_cast<std::ptrdiff_t>(at - saved_names.begin());
    const auto scales = saved.scales.begin() + b * cpu::kFp8Roles;
    kept.scales.insert(kept.scales.end(), scales, scales + cpu::kFp8Roles);
    const auto history = saved.histories.begin() + b * cpu::kFp8Roles * length;
    kept.histories.insert(kept.histories.end(), history, history + cpu::kFp8Roles * length);
  }
  return kept;
}

void Fp8Projections::set_tensor_parallel_group(TensorParallel& group) {
  for (const auto* all : {&layer_projections_, &head_projections_})
    for (const Projections& p : *all)
      FORGE_CHECK(p.linears.empty(), "FP8 projections: the tensor-parallel group is set before any layer is handed out");
  tensor_parallel_ = &group;
}

void Fp8Projections::set_base(ParamSource& weights, GradSink& gradients) {
  FORGE_CHECK(!settings_.frozen, "FP8 projections of a frozen base take no gradient sink");
  weights_ = &weights;
  gradients_ = &gradients;
}

void Fp8Projections::set_base(ParamSource& weights) {
  FORGE_CHECK(settings_.frozen, "FP8 projections of trained weights need a gradient sink");
  weights_ = &weights;
}

ParamSource& Fp8Projections::weights() const {
  FORGE_CHECK(weights_, "FP8 projections used before set_base");
  return *weights_;
}

GradSink& Fp8Projections::gradients() const {
  FORGE_CHECK(!settings_.frozen, "FP8 projections of a frozen base hand out no gradients (NOTE [FP8 frozen base])");
  FORGE_CHECK(gradients_, "FP8 projections used before set_base");
  return *gradients_;
}

const BlockWeights& Fp8Projections::with_fp8(const BlockWeights& base, int index, std::vector<BlockWeights>& out) {
  BlockWeights& block = out.at(static_cast<size_t>(index));
  block = base;
  Projections& p = projections(layer_projections_, static_cast<size_t>(index), block.params.size());
  for (size_t k = 0; k < block.params.size(); ++k) {
    if (projection_of_.at(static_cast<size_t>(index)).at(k) < 0) continue;
    block.params[k].fp8 = &p.linears[k];
    // NOTE [FP8 expert stack state]: made the first time the stack's shape is seen (its
    // local experts), for the weight and gradient descriptors alike.
    const Tensor& stack = block.params[k].weight;
    if (expert_stack_.at(static_cast<size_t>(index)).at(k) && !p.linears[k].experts && stack.defined() &&
        stack.ndim() == 3) {
      Fp8ExpertStack& s = p.experts[k];
      init_fp8_expert_stack(s, stack.dim(0), stack.dim(1), stack.dim(2), device_, settings_.weight_cache,
                            &expert_generation_, expert_row_codes_.defined() ? &expert_row_codes_ : nullptr);
      s.cache_in_use = caches_usable();
      p.linears[k].experts = &s;
    }
  }
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
