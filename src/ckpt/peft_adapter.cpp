#include "ckpt/peft_adapter.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ckpt/hf_layout.h"
#include "ckpt/safetensors.h"
#include "core/durable_directory.h"
#include "core/error.h"
#include "core/json_input.h"

namespace forge {

using nlohmann::json;

namespace {

constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";

// PEFT's rank_pattern and alpha_pattern of these adapters: {".*\\.gate_up_proj": 2 r} and
// {...: 2 alpha} where the experts' gate_up_proj takes a doubled rank (all-linear on a MoE
// model, LoraTarget::rank_multiple), else empty.
std::pair<json, json> rank_and_alpha_patterns(const LoraAdapters& adapters) {
  const LoraConfig& lora = adapters.lora_config();
  json ranks = json::object(), alphas = json::object();
  for (const LoraTarget& t : adapters.targets())
    if (t.rank_multiple != 1) {
      const std::string pattern = ".*\\." + t.parts.front().module.substr(t.parts.front().module.find('.') + 1);
      ranks[pattern] = lora.rank * t.rank_multiple;
      alphas[pattern] = lora.alpha * static_cast<double>(t.rank_multiple);
    }
  return {ranks, alphas};
}

json adapter_config(const LoraAdapters& adapters, const std::string& base_model) {
  const LoraConfig& lora = adapters.lora_config();
  std::set<std::string> modules, parameters;
  for (const LoraTarget& t : adapters.targets())
    for (const LoraPart& p : t.parts) (t.experts > 0 ? parameters : modules).insert(p.module);
  json j{{"peft_type", "LORA"},
              {"task_type", "CAUSAL_LM"},
              {"base_model_name_or_path", base_model.empty() ? json(nullptr) : json(base_model)},
              {"r", lora.rank},
              {"lora_alpha", lora.alpha},
              {"lora_dropout", lora.dropout},
              {"target_modules", std::vector<std::string>(modules.begin(), modules.end())},
              {"bias", "none"},
              {"fan_in_fan_out", false},
              {"inference_mode", true},
              {"init_lora_weights", true},
              {"modules_to_save", nullptr},
              {"layers_to_transform", nullptr},
              {"rank_pattern", rank_and_alpha_patterns(adapters).first},
              {"alpha_pattern", rank_and_alpha_patterns(adapters).second},
              {"use_rslora", false},
              {"use_dora", false},
              {"library_name", "forge"}};
  // NOTE [LoRA on routed experts]: PEFT adapts the experts' stacks as parameters, matching
  // these names as suffixes of mlp.experts.gate_up_proj / down_proj.
  if (!parameters.empty()) j["target_parameters"] = std::vector<std::string>(parameters.begin(), parameters.end());
  return j;
}

// PEFT 0.21 on transformers 5 writes what it adapts as a parameter in target_parameters:
// the router (a MoE block's gate.weight: forge's module 'gate', NOTE [LoRA on MoE and MLA
// models] in model/lora.h) and the routed experts' stacks (gate_up_proj and down_proj, or
// with their module path, e.g. mlp.experts.gate_up_proj: forge's experts.gate_up_proj and
// experts.down_proj, NOTE [LoRA on routed experts] in ops/lora_experts.h). PEFT matches each
// name as the parameter's full name or a suffix of it after a dot.
std::string parameter_module(const std::string& name) {
  const auto is = [&](const std::string& parameter) { return name == parameter || name.ends_with("." + parameter); };
  if (is("gate.weight")) return kLoraRouterModule;
  for (const std::string& m : kLoraExpertModules) {
    const std::string stack = m.substr(m.find('.') + 1);  // gate_up_proj, down_proj
    if (name == stack || is(m)) return m;
  }
  return "";
}

void add_target_parameters(const json& j, const std::string& path, std::vector<std::string>& found) {
  const json parameters = j.value("target_parameters", json());
  if (parameters.is_null()) return;
  if (!parameters.is_array())
    FORGE_FAIL("{}: target_parameters is {}, expected a list of parameter names", path, parameters.dump());
  for (const json& t : parameters) {
    const std::string name = t.is_string() ? t.get<std::string>() : t.dump();
    const std::string module = parameter_module(name);
    if (module.empty())
      FORGE_FAIL("{}: target_parameters names '{}': forge adapts no parameter but a Mixture-of-Experts router's "
                 "(gate.weight) and routed experts' stacks (gate_up_proj, down_proj, as experts.gate_up_proj, "
                 "experts.down_proj or with their module path)",
                 path, name);
    if (std::find(found.begin(), found.end(), module) == found.end()) found.push_back(module);
  }
}

// Only the names this model has a projection of: PEFT ignores names that match nothing.
std::vector<std::string> present_in(const std::vector<std::string>& names, const ModelConfig& config) {
  const std::vector<std::string> present = lora_model_modules(config);
  std::vector<std::string> kept;
  for (const std::string& name : names)
    if (std::find(present.begin(), present.end(), name) != present.end()) kept.push_back(name);
  return kept;
}

// The B rows of `part` in the Hugging Face tensor's order (DeepSeek's interleaved rotary
// rows, NOTE [LoRA on MoE and MLA models]): the tensor's row t is forge's row order[t].
std::vector<int64_t> hf_row_order(const LoraPart& part, const LoraAdapters& adapters) {
  if (part.rotary_rows.period == 0 || !adapters.interleaved_rotary()) return {};
  return rotary_row_order(part.rotary_rows, part.row_end - part.row_begin);
}

// The adapter must be the plain LoRA the run configures.
void check_adapter_config(const json& j, const std::string& path, const LoraAdapters& adapters) {
  const LoraConfig& lora = adapters.lora_config();
  auto fail = [&](const std::string& what) { FORGE_FAIL("{}: {}", path, what); };
  if (!j.is_object()) fail("expected a JSON object");
  if (j.value("peft_type", std::string()) != "LORA")
    fail(fmt::format("peft_type is {}, expected \"LORA\"", j.contains("peft_type") ? j["peft_type"].dump() : "missing"));
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() != lora.rank)
    fail(fmt::format("r is {}, but lora.rank is {}: set lora.rank to the adapter's rank",
                     j.contains("r") ? j["r"].dump() : "missing", lora.rank));
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number() || j["lora_alpha"].get<double>() != lora.alpha)
    fail(fmt::format("lora_alpha is {}, but lora.alpha is {}: set lora.alpha to the adapter's",
                     j.contains("lora_alpha") ? j["lora_alpha"].dump() : "missing", lora.alpha));
  std::vector<std::string> expected = lora_modules_for_model(adapters.config(), lora.target_modules);
  std::vector<std::string> found;
  const json targets = j.value("target_modules", json());
  if (targets.is_string() && targets.get<std::string>() == "all-linear") {
    found = lora_modules_for_model(adapters.config(), "all-linear");
  } else if (targets.is_array()) {
    for (const json& t : targets) {
      if (!t.is_string()) fail(fmt::format("target_modules holds {}, expected module names", t.dump()));
      // PEFT writes all-linear out as module paths ("model.layers.0.mlp.up_proj"); which
      // layers carry one is checked by the tensors below.
      std::string name = t.get<std::string>();
      name = name.substr(name.rfind('.') + 1);
      if (std::find(found.begin(), found.end(), name) == found.end()) found.push_back(name);
    }
  } else if (!targets.is_null()) {
    fail(fmt::format("target_modules is {}, expected a list of module names", targets.dump()));
  }
  add_target_parameters(j, path, found);
  found = present_in(found, adapters.config());
  expected = present_in(expected, adapters.config());
  std::sort(found.begin(), found.end());
  std::sort(expected.begin(), expected.end());
  if (found != expected)
    fail(fmt::format("target_modules are [{}], but lora.target_modules is '{}': set it to the adapter's",
                     fmt::join(found, ", "), lora.target_modules));
  auto require = [&](const char* key, const json& plain) {
    if (j.contains(key) && !j[key].is_null() && j[key] != plain)
      fail(fmt::format("{} is {}: forge trains plain LoRA adapters ({} {})", key, j[key].dump(), key, plain.dump()));
  };
  require("use_dora", false);
  require("use_rslora", false);
  require("fan_in_fan_out", false);
  require("bias", "none");
  // all-linear on a MoE model: the experts' gate_up_proj at twice the rank and alpha, as PEFT.
  const auto [ranks, alphas] = rank_and_alpha_patterns(adapters);
  for (const auto& [key, plain] : {std::pair{"rank_pattern", ranks}, std::pair{"alpha_pattern", alphas}}) {
    const json found = j.contains(key) && !j[key].is_null() ? j[key] : json::object();
    bool same = found.is_object() && found.size() == plain.size();
    for (auto it = plain.begin(); same && it != plain.end(); ++it)
      same = found.contains(it.key()) && found[it.key()].is_number() &&
             found[it.key()].get<double>() == it.value().get<double>();
    if (!same)
      fail(fmt::format("{} is {}, expected {} for lora.rank {}, lora.alpha {} and lora.target_modules '{}' (forge "
                       "trains plain LoRA adapters; all-linear on a Mixture-of-Experts model doubles the rank and "
                       "alpha of the experts' gate_up_proj, as PEFT 0.21 does)",
                       key, found.dump(), plain.dump(), lora.rank, lora.alpha, lora.target_modules));
  }
  require("layers_to_transform", nullptr);
  require("modules_to_save", nullptr);
}

}  // namespace

void save_peft_adapter(const std::string& dir, const LoraAdapters& adapters, const std::string& base_model) {
  std::vector<Tensor> values;
  std::vector<SafetensorsTensorRef> refs;
  const auto& targets = adapters.targets();
  for (size_t k = 0; k < targets.size(); ++k)
    for (size_t p = 0; p < targets[k].parts.size(); ++p)
      for (char m : {'a', 'b'}) {
        values.push_back(adapters.part_matrix(k, p, m));
        const std::vector<int64_t> order = m == 'b' ? hf_row_order(targets[k].parts[p], adapters) : std::vector<int64_t>{};
        if (!order.empty()) {  // row t of the tensor is forge's row order[t]
          const Tensor forge_rows = values.back().clone();
          for (size_t t = 0; t < order.size(); ++t)
            values.back().narrow(static_cast<int64_t>(t), static_cast<int64_t>(t) + 1)
                .copy_from(forge_rows.narrow(order[t], order[t] + 1));
        }
        refs.push_back({peft_tensor_name(targets[k].parts[p], m), values.back().shape(), values.back().data<float>()});
      }
  AtomicDirectory out(dir, DurableOptions{});
  write_safetensors(out.temporary_path() + "/" + kWeightsFile, refs, SafetensorsDType::F32, {{"format", "pt"}});
  write_file_atomic(out.temporary_path() + "/" + kConfigFile, adapter_config(adapters, base_model).dump(2) + "\n",
                    DurableOptions{});
  out.commit();
}

void load_peft_adapter(const std::string& dir, LoraAdapters& adapters) {
  const std::string config_path = dir + "/" + kConfigFile, weights_path = dir + "/" + kWeightsFile;
  if (!std::filesystem::is_directory(dir))
    FORGE_FAIL("lora.adapter_path '{}' is not a directory (expected a PEFT adapter: {} and {})", dir, kConfigFile,
               kWeightsFile);
  check_adapter_config(read_json_file(config_path, "PEFT adapter config"), config_path, adapters);
  const SafetensorsFile file(weights_path);
  std::set<std::string> expected;
  const auto& targets = adapters.targets();
  const int64_t r = adapters.lora_config().rank;
  for (size_t k = 0; k < targets.size(); ++k)
    for (size_t p = 0; p < targets[k].parts.size(); ++p) {
      const LoraPart& part = targets[k].parts[p];
      for (char m : {'a', 'b'}) {
        std::string name = peft_tensor_name(part, m);
        const SafetensorsEntry* entry = file.find(name);
        if (!entry && !part.hf_alias_prefix.empty()) {  // transformers 5's in-memory name (PEFT 0.21 writes it)
          LoraPart alias = part;
          alias.hf_prefix = part.hf_alias_prefix;
          if ((entry = file.find(peft_tensor_name(alias, m)))) name = peft_tensor_name(alias, m);
        }
        expected.insert(name);
        if (!entry) FORGE_FAIL("{}: no tensor '{}' (the adapter does not match the model or lora.target_modules)",
                               weights_path, name);
        const int64_t experts = targets[k].experts;  // NOTE [LoRA on routed experts]: A [E r, in], B [out, r E]
        const int64_t rt = r * targets[k].rank_multiple;
        const Shape shape = experts > 0 ? (m == 'a' ? Shape{experts * rt, targets[k].in}
                                                    : Shape{targets[k].out, rt * experts})
                            : m == 'a'  ? Shape{r, targets[k].in}
                                        : Shape{part.row_end - part.row_begin, r};
        if (entry->shape != shape)
          FORGE_FAIL("{}: tensor '{}' is {}, expected {} (lora.rank {} and the model's dimensions)", weights_path, name,
                     shape_str(entry->shape), shape_str(shape), r);
        Tensor values = Tensor::empty(shape);
        file.read_as_float(*entry, values.data<float>());
        const std::vector<int64_t> order = m == 'b' ? hf_row_order(part, adapters) : std::vector<int64_t>{};
        if (!order.empty()) {  // row t of the tensor is forge's row order[t]
          const Tensor hf_rows = values.clone();
          for (size_t t = 0; t < order.size(); ++t)
            values.narrow(order[t], order[t] + 1)
                .copy_from(hf_rows.narrow(static_cast<int64_t>(t), static_cast<int64_t>(t) + 1));
        }
        adapters.set_part_matrix(k, p, m, values);
      }
    }
  for (const SafetensorsEntry& entry : file.entries())
    if (!expected.count(entry.name))
      FORGE_FAIL("{}: tensor '{}' is not an adapter of this model with lora.target_modules '{}'", weights_path,
                 entry.name, adapters.lora_config().target_modules);
  adapters.refresh_compute();
}

LoraConfig read_peft_adapter_settings(const std::string& dir) {
  const std::string path = dir + "/" + kConfigFile;
  if (!std::filesystem::is_directory(dir))
    FORGE_FAIL("adapter '{}' is not a directory (expected a PEFT adapter: {} and {})", dir, kConfigFile, kWeightsFile);
  const json j = read_json_file(path, "PEFT adapter config");
  auto fail = [&](const std::string& what) { FORGE_FAIL("{}: {}", path, what); };
  if (!j.is_object()) fail("expected a JSON object");
  LoraConfig lora;
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1 ||
      !lora_bounds::rank.contains(static_cast<double>(j["r"].get<int64_t>())))
    fail(fmt::format("r is {}, expected the rank, an integer in [1, {}]", j.contains("r") ? j["r"].dump() : "missing",
                     *lora_bounds::rank.max));
  lora.rank = j["r"].get<int64_t>();
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number() || !(j["lora_alpha"].get<double>() > 0))
    fail(fmt::format("lora_alpha is {}, expected a number > 0",
                     j.contains("lora_alpha") ? j["lora_alpha"].dump() : "missing"));
  lora.alpha = j["lora_alpha"].get<double>();
  if (j.contains("lora_dropout") && !j["lora_dropout"].is_null()) {
    if (!j["lora_dropout"].is_number() || j["lora_dropout"].get<double>() < 0 || j["lora_dropout"].get<double>() >= 1)
      fail(fmt::format("lora_dropout is {}, expected a number in [0, 1)", j["lora_dropout"].dump()));
    lora.dropout = j["lora_dropout"].get<double>();
  }
  const json targets = j.value("target_modules", json());
  std::vector<std::string> parameter_targets;
  add_target_parameters(j, path, parameter_targets);
  if (targets.is_string() && targets.get<std::string>() == "all-linear") {
    lora.target_modules = "all-linear";
  } else if ((targets.is_array() && !targets.empty()) || !parameter_targets.empty()) {
    std::set<std::string> names(parameter_targets.begin(), parameter_targets.end());
    for (const json& t : targets.is_array() ? targets : json::array()) {
      if (!t.is_string()) fail(fmt::format("target_modules holds {}, expected module names", t.dump()));
      std::string name = t.get<std::string>();
      name = name.substr(name.rfind('.') + 1);  // PEFT writes all-linear out as module paths
      if (std::find(kLoraModuleNames.begin(), kLoraModuleNames.end(), name) == kLoraModuleNames.end())
        fail(fmt::format("target_modules names '{}', which forge cannot adapt (expected among {})", t.get<std::string>(),
                         fmt::join(kLoraModuleNames, ", ")));
      names.insert(name);
    }
    std::vector<std::string> ordered;
    for (const std::string& m : kLoraModuleNames)
      if (names.count(m)) ordered.push_back(m);
    lora.target_modules = fmt::format("{}", fmt::join(ordered, ","));
    // PEFT 0.21's all-linear on a MoE model writes its modules out and doubles the experts'
    // gate_up_proj rank (rank_pattern): forge's all-linear, which load_peft_adapter then
    // checks module by module against the model.
    const json ranks = j.value("rank_pattern", json());
    const std::string doubled = ".*\\.gate_up_proj";
    if (names.count(kLoraExpertModules[0]) && ranks.is_object() && ranks.size() == 1 && ranks.contains(doubled) &&
        ranks[doubled].is_number_integer() && ranks[doubled].get<int64_t>() == 2 * lora.rank)
      lora.target_modules = "all-linear";
  } else {
    fail(fmt::format("target_modules is {}, expected a non-empty list of module names or \"all-linear\"",
                     targets.dump()));
  }
  return lora;
}

}  // namespace forge
