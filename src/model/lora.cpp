#include "model/lora.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "core/rng.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/moe.h"

namespace forge {
namespace {

// "model.layers.3.self_attn.q_proj.weight" -> "q_proj"
std::string module_of(const std::string& hf_name) {
  const std::string stem = hf_name.substr(0, hf_name.rfind('.'));
  return stem.substr(stem.rfind('.') + 1);
}

// Each adapter tensor starts 256-byte aligned in bf16 (512 in fp32) in the flat buffers,
// as cuBLASLt's algorithms assume of their operands by default.
constexpr int64_t kAlignValues = 128;
int64_t aligned(int64_t n) { return (n + kAlignValues - 1) / kAlignValues * kAlignValues; }

uint64_t name_hash(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : name) h = (h ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
  return h;
}

// NOTE [LoRA on routed experts]: forge's b [E out, r] (expert e's B_e in rows [e out,
// (e+1) out)) and PEFT's lora_B [out, r E] (B_e[o, c] at column c E + e).
Tensor expert_b_to_peft(const Tensor& b, int64_t experts, int64_t out, int64_t r) {
  Tensor peft = Tensor::empty({out, r * experts});
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t c = 0; c < r; ++c)
        peft.data<float>()[o * r * experts + c * experts + e] = b.data<float>()[(e * out + o) * r + c];
  return peft;
}
Tensor expert_b_from_peft(const Tensor& peft, int64_t experts, int64_t out, int64_t r) {
  Tensor b = Tensor::empty({experts * out, r});
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t c = 0; c < r; ++c)
        b.data<float>()[(e * out + o) * r + c] = peft.data<float>()[o * r * experts + c * experts + e];
  return b;
}

std::string stem(const std::string& name) {
  return name.size() > 7 && name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
}

// The most rows one expert GEMM call sees: every permuted row of `tokens` tokens (N k, or
// E x capacity with padding, NOTE [MoE capacity]), which bounds any one expert's.
int64_t expert_adapter_rows(const ModelConfig& config, int64_t tokens) {
  const MoeCapacity capacity{config.moe_capacity_factor, config.moe_token_drop_policy == "position",
                             config.moe_pad_to_capacity};
  return capacity.permuted_rows(tokens, config.num_experts_per_tok, config.num_experts);
}

}  // namespace

std::vector<LoraTarget> lora_targets(const ModelConfig& config, const std::vector<std::string>& modules) {
  std::vector<LoraTarget> targets;
  std::vector<size_t> next_entry(static_cast<size_t>(config.num_layers), 0);
  const auto named = [&](const std::string& m) {
    return std::find(modules.begin(), modules.end(), m) != modules.end();
  };
  for (const ParamSpec& spec : parameter_specs(config)) {
    if (spec.layer < 0) continue;
    const size_t entry = next_entry[static_cast<size_t>(spec.layer)]++;
    if (spec.expert_stack && spec.shape.size() == 3 && !spec.hf_alias.empty()) {
      // NOTE [LoRA on routed experts]: PEFT's ParamWrapper on mlp.experts.<stack>; with both
      // stacks adapted it nests them, gate_up_proj's the inner one (experts.base_layer).
      const std::string parameter = spec.hf_alias.substr(spec.hf_alias.rfind('.') + 1);
      const std::string module = "experts." + parameter;
      if (!named(module)) continue;
      std::string prefix = spec.hf_alias.substr(0, spec.hf_alias.rfind('.'));
      if (module == kLoraExpertModules[0] && named(kLoraExpertModules[1])) prefix += ".base_layer";
      LoraTarget target{spec.layer, entry, spec.name, spec.shape[2], spec.shape[1], {}, spec.shape[0]};
      target.parts.push_back({module, prefix, 0, spec.shape[1]});
      targets.push_back(std::move(target));
      continue;
    }
    if (spec.shape.size() != 2) continue;
    LoraTarget target{spec.layer, entry, spec.name, spec.shape[1], spec.shape[0], {}};
    // NOTE [Fused LoRA targets]: a fused name takes the whole projection as one part.
    std::vector<std::string> members;
    for (const HfTensor& t : spec.hf_tensors) members.push_back(module_of(t.name));
    for (const auto& [fused, fused_members] : kLoraFusedModules)
      if (members == fused_members && std::find(modules.begin(), modules.end(), fused) != modules.end()) {
        const std::string first = stem(spec.hf_tensors.front().name);
        target.parts.push_back({fused, first.substr(0, first.rfind('.') + 1) + fused, 0, spec.shape[0]});
      }
    const std::string alias = spec.hf_tensors.size() == 1 && !spec.hf_alias.empty() ? stem(spec.hf_alias) : "";
    int64_t row = 0;
    for (const HfTensor& t : spec.hf_tensors) {
      const std::string module = module_of(t.name);
      if (std::find(modules.begin(), modules.end(), module) != modules.end())
        target.parts.push_back({module, stem(t.name), row, row + t.rows, alias, t.rotary_rows});
      row += t.rows;
    }
    if (!target.parts.empty()) targets.push_back(std::move(target));
  }
  return targets;
}

// NOTE [LoRA on routed experts]: PEFT 0.21's all-linear on transformers 5 converts the v4
// experts' w1 and w3 (gate_proj and up_proj), two rank-r adapters, into one on the fused
// gate_up_proj stack of rank 2 r and alpha 2 alpha (its rank_pattern and alpha_pattern).
std::vector<LoraTarget> lora_targets(const ModelConfig& config, const LoraConfig& lora) {
  const std::vector<std::string> modules = lora_modules_for_model(config, lora.target_modules);
  std::vector<LoraTarget> targets = lora_targets(config, modules);
  if (config.moe() && lora_target_modules(lora.target_modules) == kLoraModules)
    for (LoraTarget& t : targets)
      if (t.experts > 0 && t.parts.front().module == kLoraExpertModules[0]) t.rank_multiple = 2;
  return targets;
}

std::vector<std::string> lora_model_modules(const ModelConfig& config) {
  std::vector<std::string> present;
  for (const LoraTarget& t : lora_targets(config, kLoraModuleNames))
    for (const LoraPart& p : t.parts)
      if (std::find(present.begin(), present.end(), p.module) == present.end()) present.push_back(p.module);
  return present;
}

std::vector<std::string> lora_modules_for_model(const ModelConfig& config, const std::string& target_modules,
                                                const KeyDescriber& keys) {
  std::vector<std::string> modules = lora_target_modules(target_modules, keys);
  if (config.moe() && modules == kLoraModules)  // all-linear, NOTE [LoRA on MoE and MLA models]
    std::erase_if(modules, [](const std::string& m) { return m == "gate_proj" || m == "up_proj" || m == "down_proj"; });
  return modules;
}

// NOTE [LoRA on MoE and MLA models].
void check_lora_for_model(const ModelConfig& config, const LoraConfig& lora, const KeyDescriber& keys) {
  if (!lora.enabled()) return;
  const std::vector<std::string> modules = lora_target_modules(lora.target_modules, keys);
  const bool all_linear = modules == kLoraModules;
  const std::string key = keys.describe("lora.target_modules", lora.target_modules);
  const auto named = [&](const std::string& m) {
    return std::find(modules.begin(), modules.end(), m) != modules.end();
  };
  const bool router = named(kLoraRouterModule), experts = named(kLoraExpertModules[0]) || named(kLoraExpertModules[1]);
  if (all_linear && !config.moe()) return;  // the modules the model has
  if (router && !config.moe())
    FORGE_FAIL("{} names the router '{}', and this model has none (model.num_experts 0)", key, kLoraRouterModule);
  for (const std::string& m : kLoraExpertModules)
    if (named(m) && !config.moe())
      FORGE_FAIL("{} names the routed experts' '{}', and this model has none (model.num_experts 0)", key, m);
  if ((router || experts) && lora.dropout > 0.0)
    FORGE_FAIL("{} adapts {} with {}: PEFT adapts {} (target_parameters, its ParamWrapper), which {} no dropout; "
               "set lora.dropout 0{}",
               key, all_linear ? "the router and the routed experts" : experts ? "the routed experts" : "the router",
               keys.describe("lora.dropout", lora.dropout), experts ? "them as parameters" : "it as a parameter",
               experts ? "take" : "takes",
               all_linear ? ", or name the modules instead of all-linear, leaving out gate and experts.*"
                          : " or leave them out of lora.target_modules");
}

// NOTE [LoRA FLOPs]: the frozen weights are the active ones (a MoE token runs only its
// experts), as ModelConfig::flops_per_token counts them; attention is that count's.
double training_flops_per_token(const ModelConfig& config, const LoraConfig& lora, int64_t seq_len) {
  if (!lora.enabled()) return config.flops_per_token(seq_len);
  double frozen = static_cast<double>(config.active_params() - config.embedding_params());
  if (config.tie_word_embeddings) frozen += static_cast<double>(config.vocab_size * config.hidden_size);
  const double adapters = lora_sizes(config, lora, 1).active_trainable;
  const double attention = config.flops_per_token(seq_len) - 6.0 * frozen;
  return 4.0 * frozen + 6.0 * adapters + attention;
}

LoraSizes lora_sizes(const ModelConfig& config, const LoraConfig& lora, int64_t tokens, int64_t expert_parallel) {
  LoraSizes sizes;
  int64_t widest_low_rank = 0, widest_in = 0;
  bool experts = false;
  for (const LoraTarget& t : lora_targets(config, lora)) {
    if (t.experts > 0) {  // NOTE [LoRA on routed experts]: every expert's A and B
      const int64_t values = t.experts * lora.rank * t.rank_multiple * (t.in + t.out);
      sizes.stored += values;
      sizes.trainable += values;
      sizes.active_trainable += static_cast<double>(values) * static_cast<double>(config.num_experts_per_tok) /
                                static_cast<double>(t.experts);
      experts = true;
      continue;
    }
    const int64_t low = lora.rank * static_cast<int64_t>(t.parts.size());
    sizes.stored += low * (t.in + t.out);
    for (const LoraPart& p : t.parts) {
      sizes.trainable += lora.rank * (t.in + p.row_end - p.row_begin);
      sizes.active_trainable += static_cast<double>(lora.rank * (t.in + p.row_end - p.row_begin));
    }
    widest_low_rank = std::max(widest_low_rank, low);
    widest_in = std::max(widest_in, t.in);
  }
  sizes.workspace = 2 * widest_low_rank * tokens + (lora.dropout > 0.0 ? widest_in * tokens : 0) +
                    (experts ? 2 * 2 * lora.rank * expert_adapter_rows(config, tokens) * expert_parallel : 0);
  return sizes;
}

std::string peft_tensor_name(const LoraPart& part, char matrix) {
  return fmt::format("base_model.model.{}.lora_{}.weight", part.hf_prefix, matrix == 'a' ? 'A' : 'B');
}

LoraAdapters::LoraAdapters(const ModelConfig& config, const LoraConfig& lora, Device device, int64_t tokens,
                           TensorParallelShard shard)
    : config_(config), lora_(lora), device_(device), shard_(shard) {
  lora_.validate();
  FORGE_CHECK(lora_.enabled(), "LoRA adapters with lora.rank 0");
  check_lora_for_model(config_, lora_);
  targets_ = lora_targets(config_, lora_);
  FORGE_CHECK(!targets_.empty(), "lora.target_modules '{}' adapts no projection of the model", lora_.target_modules);
  const int64_t r = lora_.rank;
  int64_t total = 0, widest_low_rank = 0, widest_in = 0;
  bool experts = false;
  for (const LoraTarget& t : targets_) {
    const int64_t low = r * t.rank_multiple * (t.experts > 0 ? t.experts : static_cast<int64_t>(t.parts.size()));
    total += aligned(low * t.in) + aligned(low * t.out);
    experts = experts || t.experts > 0;
    if (t.experts > 0) continue;
    widest_low_rank = std::max(widest_low_rank, low);
    widest_in = std::max(widest_in, t.in);
  }
  const DType compute = device == Device::CUDA ? DType::BF16 : DType::F32;
  master_flat_ = Tensor::zeros({total}, DType::F32, device);
  grad_flat_ = Tensor::zeros({total}, DType::F32, device);
  compute_flat_ = compute == DType::F32 ? master_flat_ : Tensor::zeros({total}, compute, device);
  workspace_.low_rank = Tensor::zeros({widest_low_rank * tokens}, compute, device);
  workspace_.low_rank_grad = Tensor::zeros({widest_low_rank * tokens}, compute, device);
  if (lora_.dropout > 0.0) workspace_.wide = Tensor::zeros({widest_in * tokens}, compute, device);
  if (experts) {  // NOTE [LoRA on routed experts]
    expert_rows_ = expert_adapter_rows(config_, tokens);
    expert_workspace_.low_rank = Tensor::zeros({2 * r * expert_rows_}, compute, device);  // 2: rank_multiple
    expert_workspace_.low_rank_grad = Tensor::zeros({2 * r * expert_rows_}, compute, device);
  }

  target_of_.assign(static_cast<size_t>(config_.num_layers), {});
  adapters_.resize(targets_.size());
  expert_adapters_.resize(targets_.size());
  int64_t offset = 0;
  auto take = [&](const Tensor& flat, Shape shape, int64_t at) {
    return flat.narrow(at, at + shape_numel(shape)).view(std::move(shape));
  };
  // An adapter's A and B: their compute copies and gradients (set in `adapter`), masters
  // and gradients (listed), at the next aligned places of the flat buffers.
  auto place = [&](auto& adapter, const Shape& a, const Shape& b) {
    for (const auto& [shape, weight, grad] :
         {std::tuple{a, &adapter.a, &adapter.grad_a}, std::tuple{b, &adapter.b, &adapter.grad_b}}) {
      *weight = take(compute_flat_, shape, offset);
      *grad = take(grad_flat_, shape, offset);
      masters_.push_back(take(master_flat_, shape, offset));
      grads_.push_back(*grad);
      offset += aligned(shape_numel(shape));
    }
  };
  for (size_t k = 0; k < targets_.size(); ++k) {
    const LoraTarget& t = targets_[k];
    if (t.experts > 0) {  // NOTE [LoRA on routed experts]
      const int64_t rt = r * t.rank_multiple;
      LoraExpertAdapter& adapter = expert_adapters_[k];
      place(adapter, {t.experts * rt, t.in}, {t.experts * t.out, rt});
      adapter.rank = rt;
      adapter.experts = t.experts;
      adapter.scale = static_cast<float>(lora_.alpha / static_cast<double>(r));
      adapter.workspace = &expert_workspace_;
      continue;
    }
    const int64_t low = r * static_cast<int64_t>(t.parts.size());
    LoraAdapter& adapter = adapters_[k];
    place(adapter, {low, t.in}, {t.out, low});
    adapter.rank = r;
    adapter.scale = static_cast<float>(lora_.alpha / static_cast<double>(r));
    adapter.dropout = static_cast<float>(lora_.dropout);
    for (const LoraPart& p : t.parts) adapter.parts.push_back({p.row_begin, p.row_end});
    adapter.workspace = &workspace_;
  }

  // The gradient side: frozen projections and expert stacks (no tensor), the adapters'
  // buffers, one scratch for the vectors (norm weights, routing biases) whose gradients
  // the components compute anyway.
  const std::vector<ParamSpec> specs = parameter_specs(config_);
  int64_t widest_vector = config_.hidden_size;
  for (const ParamSpec& spec : specs)
    if (spec.layer >= 0 && spec.shape.size() == 1) widest_vector = std::max(widest_vector, spec.shape[0]);
  vector_scratch_ = Tensor::zeros({widest_vector}, DType::F32, device);
  norm_scratch_ = vector_scratch_.narrow(0, config_.hidden_size);
  grad_layers_.assign(static_cast<size_t>(config_.num_layers), {});
  for (const ParamSpec& spec : specs) {
    if (spec.layer < 0) continue;
    FORGE_CHECK(spec.shape.size() >= 1 && spec.shape.size() <= 3,
                "parameter '{}' {} is neither a vector, a projection nor a stack of them", spec.name,
                shape_str(spec.shape));
    BlockWeights& block = grad_layers_[static_cast<size_t>(spec.layer)];
    block.params.push_back(spec.shape.size() == 1 ? LinearWeight{vector_scratch_.narrow(0, spec.shape[0])}
                                                  : LinearWeight{});
    target_of_[static_cast<size_t>(spec.layer)].push_back(-1);
  }
  for (size_t k = 0; k < targets_.size(); ++k) {
    const LoraTarget& t = targets_[k];
    LinearWeight& g = grad_layers_[static_cast<size_t>(t.layer)].params.at(t.param);
    if (t.experts > 0) g.experts_lora = &expert_adapters_[k];
    else g.lora = &adapters_[k];
    target_of_[static_cast<size_t>(t.layer)].at(t.param) = static_cast<int>(k);
  }
  layers_.assign(static_cast<size_t>(config_.num_layers), {});
  fresh_.assign(static_cast<size_t>(config_.num_layers), 1);
  if (shard_.size > 1) split_over_tensor_parallel_ranks(specs, compute);
}

// NOTE [LoRA under context and tensor parallelism]: a column-parallel projection's B is split
// by the rows its weight is (each part's rows of the shard contiguous, as the heads' and the
// feed-forward's are), a row-parallel one's A by its columns; the other matrix stays whole.
void LoraAdapters::split_over_tensor_parallel_ranks(const std::vector<ParamSpec>& specs, DType compute) {
  int64_t total = 0;
  std::vector<Shape> shapes;
  for (size_t k = 0; k < targets_.size(); ++k) {
    const LoraTarget& t = targets_[k];
    const auto spec = std::find_if(specs.begin(), specs.end(), [&](const ParamSpec& p) { return p.name == t.name; });
    FORGE_CHECK(spec != specs.end(), "LoRA target '{}' is no parameter of the model", t.name);
    if (spec->tensor_parallel == TensorParallelSplit::Replicated) continue;
    FORGE_CHECK(t.experts == 0, "LoRA target '{}': the routed experts are not split by tensor parallelism", t.name);
    LoraAdapter& adapter = adapters_[k];
    const int64_t low = adapter.low_rank();
    ShardedMatrix s;
    s.target = k;
    if (spec->tensor_parallel == TensorParallelSplit::Rows) {
      s.matrix = 'b';
      s.whole_compute = adapter.b;
      s.whole_grad = adapter.grad_b;
      int64_t rows = 0;
      for (const ShardRun& run : tensor_parallel_runs(*spec, shard_)) {
        s.rows.push_back({run.local_begin / t.in, run.full_begin / t.in, run.count / t.in});
        rows += run.count / t.in;
      }
      std::vector<LoraPartRows> parts;
      for (const LoraPart& p : t.parts) {
        int64_t begin = -1, end = -1;
        for (const ShardRun& run : s.rows) {
          const int64_t lo = std::max(p.row_begin, run.full_begin);
          const int64_t hi = std::min(p.row_end, run.full_begin + run.count);
          if (lo >= hi) continue;
          const int64_t local = run.local_begin + lo - run.full_begin;
          FORGE_CHECK(begin < 0 || local == end,
                      "LoRA part '{}' of '{}': its rows on tensor-parallel rank {} of {} are not consecutive",
                      p.module, t.name, shard_.rank, shard_.size);
          if (begin < 0) begin = local;
          end = local + hi - lo;
        }
        FORGE_CHECK(begin >= 0, "LoRA part '{}' of '{}' has no rows on tensor-parallel rank {} of {}", p.module, t.name,
                    shard_.rank, shard_.size);
        parts.push_back({begin, end});
      }
      adapter.parts = std::move(parts);
      shapes.push_back({rows, low});
    } else {
      FORGE_CHECK(t.in % shard_.size == 0, "LoRA target '{}': {} input columns over {} tensor-parallel ranks", t.name,
                  t.in, shard_.size);
      s.matrix = 'a';
      s.whole_compute = adapter.a;
      s.whole_grad = adapter.grad_a;
      s.columns = t.in / shard_.size;
      s.column_begin = shard_.rank * s.columns;
      shapes.push_back({low, s.columns});
    }
    total += aligned(shape_numel(shapes.back()));
    sharded_.push_back(std::move(s));
  }
  shard_compute_flat_ = Tensor::zeros({total}, compute, device_);
  shard_grad_flat_ = Tensor::zeros({total}, DType::F32, device_);
  int64_t offset = 0;
  for (size_t i = 0; i < sharded_.size(); ++i) {
    ShardedMatrix& s = sharded_[i];
    const int64_t n = shape_numel(shapes[i]);
    s.compute = shard_compute_flat_.narrow(offset, offset + n).view(shapes[i]);
    s.grad = shard_grad_flat_.narrow(offset, offset + n).view(shapes[i]);
    offset += aligned(n);
    LoraAdapter& adapter = adapters_[s.target];
    (s.matrix == 'a' ? adapter.a : adapter.b) = s.compute;
    (s.matrix == 'a' ? adapter.grad_a : adapter.grad_b) = s.grad;
  }
}

void LoraAdapters::move_shard(const ShardedMatrix& s, const Tensor& shard, const Tensor& whole, bool take) {
  if (s.matrix == 'a') {
    if (take) copy_columns(shard, 0, whole, s.column_begin, s.columns);
    else copy_columns(whole, s.column_begin, shard, 0, s.columns);
    return;
  }
  for (const ShardRun& run : s.rows) {
    const Tensor mine = shard.narrow(run.local_begin, run.local_begin + run.count);
    const Tensor theirs = whole.narrow(run.full_begin, run.full_begin + run.count);
    if (take) mine.copy_from(theirs);
    else theirs.copy_from(mine);
  }
}

void LoraAdapters::spread_shard_gradients() {
  for (const ShardedMatrix& s : sharded_) {
    s.whole_grad.fill_zero();
    // Another pipeline rank's stage (NOTE [LoRA under pipeline parallelism]): its shard was
    // never written, its whole gradient is zero.
    if (fresh_.at(static_cast<size_t>(targets_[s.target].layer))) continue;
    move_shard(s, s.grad, s.whole_grad, false);
  }
}

std::vector<std::string> LoraAdapters::master_names() const {
  std::vector<std::string> names;
  for (const LoraTarget& t : targets_) {
    names.push_back(stem(t.name) + ".lora_a");
    names.push_back(stem(t.name) + ".lora_b");
  }
  return names;
}

std::vector<ParamSpec> LoraAdapters::checkpoint_specs() const {
  std::vector<ParamSpec> specs;
  const std::vector<std::string> names = master_names();
  for (size_t i = 0; i < masters_.size(); ++i)
    specs.push_back({names[i], masters_[i].shape(), {}, true, targets_[i / 2].layer});
  return specs;
}

void LoraAdapters::set_training(bool training) {
  for (LoraAdapter& adapter : adapters_) adapter.dropout = training ? static_cast<float>(lora_.dropout) : 0.0f;
}

int64_t LoraAdapters::stored_values() const {
  int64_t n = 0;
  for (const Tensor& t : masters_) n += t.numel();
  return n;
}

int64_t LoraAdapters::workspace_values() const {
  int64_t n = 0;
  for (const Tensor* t : {&workspace_.low_rank, &workspace_.low_rank_grad, &workspace_.wide,
                          &expert_workspace_.low_rank, &expert_workspace_.low_rank_grad})
    if (t->defined()) n += t->numel();
  return n;
}

int64_t LoraAdapters::trainable_params() const {
  int64_t n = 0;
  for (const LoraTarget& t : targets_)
    for (const LoraPart& p : t.parts)
      n += std::max<int64_t>(t.experts, 1) * lora_.rank * t.rank_multiple * (t.in + (p.row_end - p.row_begin));
  return n;
}

void LoraAdapters::initialize(uint64_t seed) {
  for (size_t k = 0; k < targets_.size(); ++k) {
    const LoraTarget& t = targets_[k];
    Tensor a = Tensor::empty(masters_[2 * k].shape());
    // kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
    const double bound = 1.0 / std::sqrt(static_cast<double>(t.in));
    Rng rng(derive_seed(seed, name_hash(t.name)));
    for (int64_t j = 0; j < a.numel(); ++j) a.data<float>()[j] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
    masters_[2 * k].copy_from(a.to(device_));
    masters_[2 * k + 1].fill_zero();
  }
  refresh_compute();
}

void LoraAdapters::refresh_compute() {
  if (compute_flat_.raw() != master_flat_.raw()) cast(compute_flat_, master_flat_);
  for (const ShardedMatrix& s : sharded_) move_shard(s, s.compute, s.whole_compute, true);
}

void LoraAdapters::set_dropout_step(uint64_t seed, uint64_t index) {
  const uint64_t step_seed = derive_seed(seed, index);
  for (size_t k = 0; k < adapters_.size(); ++k) adapters_[k].dropout_seed = derive_seed(step_seed, k + 1);
  // NOTE [LoRA under context and tensor parallelism]: a row-parallel adapter's input is the
  // rank's columns, which take masks of their own on each rank.
  for (const ShardedMatrix& s : sharded_)
    if (s.matrix == 'a')
      adapters_[s.target].dropout_seed =
          derive_seed(adapters_[s.target].dropout_seed, 1 + static_cast<uint64_t>(shard_.rank));
}

void LoraAdapters::discard() {
  std::fill(fresh_.begin(), fresh_.end(), 1);
  if (expert_degree_ == 1) return;
  // NOTE [LoRA under expert parallelism]: the other ranks' experts' rows are not written here.
  const int64_t held = config_.num_experts / expert_degree_, first = expert_index_ * held;
  for (size_t k = 0; k < targets_.size(); ++k) {
    const LoraTarget& t = targets_[k];
    if (t.experts == 0) continue;
    const int64_t r = lora_.rank * t.rank_multiple;
    for (const auto& [g, rows] : {std::pair{grads_[2 * k], r}, std::pair{grads_[2 * k + 1], t.out}}) {
      g.narrow(0, first * rows).fill_zero();
      g.narrow((first + held) * rows, t.experts * rows).fill_zero();
    }
  }
}

// NOTE [LoRA under expert parallelism].
void LoraAdapters::set_expert_parallel(int64_t index, int64_t degree) {
  FORGE_CHECK(expert_degree_ == 1, "LoRA adapters: expert parallelism set twice");
  FORGE_CHECK(degree >= 1 && index >= 0 && index < degree && config_.num_experts % degree == 0,
              "LoRA adapters: expert-parallel rank {} of {} for {} experts", index, degree, config_.num_experts);
  if (degree == 1) return;
  expert_index_ = index;
  expert_degree_ = degree;
  const int64_t held = config_.num_experts / degree, first = index * held;
  bool experts = false;
  for (size_t k = 0; k < targets_.size(); ++k) {
    const LoraTarget& t = targets_[k];
    if (t.experts == 0) continue;
    const int64_t r = lora_.rank * t.rank_multiple;
    LoraExpertAdapter& a = expert_adapters_[k];
    a.a = a.a.narrow(first * r, (first + held) * r);
    a.grad_a = a.grad_a.narrow(first * r, (first + held) * r);
    a.b = a.b.narrow(first * t.out, (first + held) * t.out);
    a.grad_b = a.grad_b.narrow(first * t.out, (first + held) * t.out);
    a.experts = held;
    experts = true;
  }
  if (!experts) return;
  // A rank's experts may receive every row of its group.
  const Shape rows{2 * lora_.rank * expert_rows_ * degree};  // 2: rank_multiple
  expert_workspace_.low_rank = Tensor::zeros(rows, expert_workspace_.low_rank.dtype(), device_);
  expert_workspace_.low_rank_grad = Tensor::zeros(rows, expert_workspace_.low_rank_grad.dtype(), device_);
}

void LoraAdapters::zero_unwritten_gradients() {
  for (size_t k = 0; k < targets_.size(); ++k) {
    if (!fresh_.at(static_cast<size_t>(targets_[k].layer))) continue;
    grads_[2 * k].fill_zero();  // A's and B's, a 2-D or a routed-expert adapter alike
    grads_[2 * k + 1].fill_zero();
  }
}

ParamSource& LoraAdapters::base() {
  FORGE_CHECK(base_, "LoRA adapters used before set_base");
  return *base_;
}

const BlockWeights& LoraAdapters::layer(int index) {
  const size_t i = static_cast<size_t>(index);
  BlockWeights& block = layers_.at(i);
  block = base().layer(index);
  FORGE_CHECK(block.params.size() == target_of_.at(i).size(), "block {} has {} weights, the adapters expect {}", index,
              block.params.size(), target_of_[i].size());
  for (size_t e = 0; e < block.params.size(); ++e) {
    if (target_of_[i][e] < 0) continue;
    const size_t k = static_cast<size_t>(target_of_[i][e]);
    if (targets_[k].experts > 0) block.params[e].experts_lora = &expert_adapters_[k];
    else block.params[e].lora = &adapters_[k];
  }
  return block;
}

Tensor& LoraAdapters::master_of(size_t target, char matrix) {
  return masters_.at(2 * target + (matrix == 'a' ? 0 : 1));
}

Tensor LoraAdapters::part_matrix(size_t target, size_t part, char matrix) const {
  const LoraTarget& t = targets_.at(target);
  const LoraPart& p = t.parts.at(part);
  const int64_t r = lora_.rank * t.rank_multiple, low = r * static_cast<int64_t>(t.parts.size());
  const int64_t k = static_cast<int64_t>(part);
  const Tensor all = masters_.at(2 * target + (matrix == 'a' ? 0 : 1)).to(Device::CPU);
  if (t.experts > 0) return matrix == 'a' ? all.clone() : expert_b_to_peft(all, t.experts, t.out, r);
  if (matrix == 'a') return all.narrow(k * r, (k + 1) * r).clone();
  const int64_t rows = p.row_end - p.row_begin;
  Tensor out = Tensor::empty({rows, r});
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t c = 0; c < r; ++c) out.data<float>()[o * r + c] = all.data<float>()[(p.row_begin + o) * low + k * r + c];
  return out;
}

void LoraAdapters::set_part_matrix(size_t target, size_t part, char matrix, const Tensor& values) {
  const LoraTarget& t = targets_.at(target);
  const LoraPart& p = t.parts.at(part);
  const int64_t r = lora_.rank * t.rank_multiple, low = r * static_cast<int64_t>(t.parts.size());
  const int64_t k = static_cast<int64_t>(part);
  Tensor& master = master_of(target, matrix);
  Tensor all = master.to(Device::CPU);
  if (t.experts > 0) {  // NOTE [LoRA on routed experts]: PEFT's A [E r, in], B [out, r E]
    check_shape(values, matrix == 'a' ? Shape{t.experts * r, t.in} : Shape{t.out, r * t.experts}, "expert LoRA");
    all.copy_from(matrix == 'a' ? values : expert_b_from_peft(values, t.experts, t.out, r));
  } else if (matrix == 'a') {
    check_shape(values, {r, t.in}, "LoRA A");
    all.narrow(k * r, (k + 1) * r).copy_from(values);
  } else {
    const int64_t rows = p.row_end - p.row_begin;
    check_shape(values, {rows, r}, "LoRA B");
    for (int64_t o = 0; o < rows; ++o)
      for (int64_t c = 0; c < r; ++c)
        all.data<float>()[(p.row_begin + o) * low + k * r + c] = values.data<float>()[o * r + c];
  }
  master.copy_from(all.to(master.device()));
}

void LoraAdapters::merge_into(FlatParameters& params) const {
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "LoRA merge into {} {} parameters (fp32 host ones expected)", device_name(params.flat().device()),
              dtype_name(params.flat().dtype()));
  std::set<std::string> held;
  for (const ParamSpec& spec : params.specs()) held.insert(spec.name);
  std::vector<const ShardedMatrix*> split(targets_.size(), nullptr);
  for (const ShardedMatrix& s : sharded_) split[s.target] = &s;
  for (size_t k = 0; k < targets_.size(); ++k) {
    if (!held.contains(targets_[k].name)) continue;  // NOTE [LoRA under pipeline parallelism]
    Tensor a = masters_[2 * k].to(Device::CPU), b = masters_[2 * k + 1].to(Device::CPU);
    const Tensor& w = params.find(targets_[k].name);
    const LoraTarget& t = targets_[k];
    if (split[k] && w.shape() != Shape{t.out, t.in}) {
      // The rank's shard of W (NOTE [LoRA under context and tensor parallelism]): its rows of
      // B (column-parallel) or its columns of A (row-parallel) make its shard of B A.
      const ShardedMatrix& s = *split[k];
      Tensor& whole = s.matrix == 'a' ? a : b;
      Tensor mine = Tensor::zeros(s.compute.shape(), DType::F32, Device::CPU);
      move_shard(s, mine, whole, true);
      whole = mine;
    }
    merge_target(k, w, a, b, {});
  }
}

void LoraAdapters::merge_into(const std::string& name, const Tensor& weight, ExpertShard experts) const {
  FORGE_CHECK(weight.device() == Device::CPU && weight.dtype() == DType::F32,
              "LoRA merge into {}: {} {} values (fp32 host ones expected)", name, device_name(weight.device()),
              dtype_name(weight.dtype()));
  for (size_t k = 0; k < targets_.size(); ++k)
    if (targets_[k].name == name)
      return merge_target(k, weight, masters_[2 * k].to(Device::CPU), masters_[2 * k + 1].to(Device::CPU), experts);
}

void LoraAdapters::merge_target(size_t k, const Tensor& w, const Tensor& a, const Tensor& b,
                                ExpertShard experts) const {
  const LoraTarget& t = targets_[k];
  const float scale = static_cast<float>(lora_.alpha / static_cast<double>(lora_.rank));
  if (t.experts == 0) {  // the whole W, or under tensor parallelism its shard with b's or a's
    matmul(w, b, false, a, false, scale, 1.0f);
    return;
  }
  // W_e += scale B_e A_e (NOTE [LoRA on routed experts]) for the experts `w` holds.
  FORGE_CHECK(experts.size >= 1 && t.experts % experts.size == 0 && experts.index >= 0 &&
                  experts.index < experts.size,
              "LoRA merge into {}: expert shard {} of {} does not split its {} experts", t.name, experts.index,
              experts.size, t.experts);
  const int64_t held = t.experts / experts.size, first = experts.index * held;
  check_shape(w, {held, t.out, t.in}, "LoRA merge into an expert stack");
  const int64_t r = lora_.rank * t.rank_multiple;
  for (int64_t e = 0; e < held; ++e)
    matmul(moe_expert_matrix(w, e), b.narrow((first + e) * t.out, (first + e + 1) * t.out), false,
           a.narrow((first + e) * r, (first + e + 1) * r), false, scale, 1.0f);
}

}  // namespace forge
