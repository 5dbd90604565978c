// One set of rules, two paths (NOTE [Config rules name their keys through the caller]):
// every rule of the model and the optimizer rejects a bad config both on the cli's path
// (load_experiment, validate_experiment), naming where each value came from, and on the
// direct path (ModelConfig::validate, optim's validate), naming the keys. A rule written
// on one path only makes the paths disagree, which the tests below catch.
#include <gtest/gtest.h>

#include <algorithm>

#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "cli/config.h"
#include "cli/config_schema.h"
#include "cli/config_validate.h"
#include "config_test_support.h"
#include "optim/config_rules.h"
#include "expect_error.h"

namespace forge {
namespace {

using config_test::ScratchDir;
using Setting = std::pair<std::string, std::string>;

// Stores `text` in the key's field as it is, without the schema's range check, so that a
// config can hold what the cli would refuse to read.
void assign(ExperimentConfig& config, const std::string& key, const std::string& text) {
  std::visit(
      [&](auto* field) {
        using Field = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<Field, bool>) {
          *field = text == "true";
        } else if constexpr (std::is_same_v<Field, std::string>) {
          *field = text;
        } else if constexpr (std::is_same_v<Field, double>) {
          *field = std::stod(text);
        } else if constexpr (std::is_same_v<Field, int64_t>) {
          *field = std::stoll(text);
        } else {
          *field = std::stoull(text);
        }
      },
      find_config_key(key)->field(config));
}

// The default experiment with `settings` assigned over it.
ExperimentConfig default_config_with(const std::vector<Setting>& settings) {
  ExperimentConfig config = load_experiment("", {});
  for (const auto& [key, value] : settings) assign(config, key, value);
  return config;
}

// What the DecoderLM constructor, Hugging Face import, forge info and tests call.
void validate_directly(const ExperimentConfig& config) {
  config.model.validate();
  validate(config.optimizer, config.lr_scheduler, config.training.steps);
}

// An experiment file that sets each key on a line of its own: settings[i] on line i + 1.
std::string write_experiment(const ScratchDir& dir, const std::vector<Setting>& settings) {
  std::string text;
  for (const auto& [key, value] : settings) text += fmt::format("{}: {}\n", key, value);
  return dir.write("exp.yaml", text);
}

// "<file>:<line>" of `key` in the file write_experiment made of `settings`.
std::string file_origin(const std::string& file, const std::vector<Setting>& settings, const std::string& key) {
  for (std::size_t i = 0; i < settings.size(); ++i) {
    if (settings[i].first == key) return fmt::format("{}:{}", file, i + 1);
  }
  ADD_FAILURE() << key << " is not in " << file;
  return "";
}

void expect_fragments(const std::string& message, const std::vector<std::string>& fragments,
                      const std::string& context) {
  EXPECT_FALSE(message.empty()) << context << ": accepted";
  for (const auto& fragment : fragments) {
    EXPECT_NE(message.find(fragment), std::string::npos) << context << "\nmessage: " << message
                                                         << "\nlacks: " << fragment;
  }
}

// The keys whose rules live in model/ and optim/: the model, optimizer and lr_scheduler
// sections, and training.steps (the schedule's length).
bool is_rule_owned_key(const ConfigKey& key) {
  return (key.name.starts_with("model.") && key.name != "model.name") || key.name.starts_with("optimizer.") ||
         key.name.starts_with("lr_scheduler.") || key.name == "training.steps";
}

// A rule that relates keys, a setting that breaks it, and the keys its message must name.
struct RelationCase {
  std::string rule;
  std::vector<Setting> settings;
  std::vector<std::string> named_keys;
};

const std::vector<RelationCase>& relation_cases() {
  static const std::vector<RelationCase> cases = {
      {"heads divisible by KV heads",
       {{"model.num_heads", "4"}, {"model.num_kv_heads", "3"}},
       {"model.num_heads", "model.num_kv_heads"}},
      {"hidden size divisible by heads",
       {{"model.hidden_size", "66"}, {"model.num_heads", "4"}, {"model.num_kv_heads", "4"}, {"model.head_dim", "0"}},
       {"model.hidden_size", "model.num_heads"}},
      {"given head size even", {{"model.head_dim", "15"}}, {"model.head_dim"}},
      {"derived head size even",
       {{"model.hidden_size", "36"}, {"model.num_heads", "4"}, {"model.head_dim", "0"}},
       {"model.hidden_size", "model.num_heads"}},
      {"RoPE scaling factors ordered",
       {{"model.rope_scaling.enabled", "true"},
        {"model.rope_scaling.low_freq_factor", "4"},
        {"model.rope_scaling.high_freq_factor", "2"}},
       {"model.rope_scaling.high_freq_factor", "model.rope_scaling.low_freq_factor"}},
      {"min_lr within lr",
       {{"optimizer.lr", "0.001"}, {"lr_scheduler.min_lr", "0.002"}},
       {"lr_scheduler.min_lr", "optimizer.lr"}},
  };
  return cases;
}

std::string value_of(const std::vector<Setting>& settings, const std::string& key) {
  for (const auto& [name, value] : settings) {
    if (name == key) return value;
  }
  ADD_FAILURE() << key << " is named but not set";
  return "";
}

// "model.num_heads = 4 (command line)" for each named key, its origin from `origin_of`.
std::vector<std::string> described_keys(const RelationCase& c,
                                        const std::function<std::string(const std::string&)>& origin_of) {
  std::vector<std::string> fragments;
  for (const auto& key : c.named_keys)
    fragments.push_back(fmt::format("{} = {} ({})", key, value_of(c.settings, key), origin_of(key)));
  return fragments;
}

TEST(ConfigRules, RelationsNameOriginsOnTheCliPath) {
  for (const auto& c : relation_cases()) {
    SCOPED_TRACE(c.rule);
    ConfigOverrides overrides(c.settings.begin(), c.settings.end());
    expect_fragments(error_of([&] { load_experiment("", overrides); }),
                     described_keys(c, [](const std::string&) { return "command line"; }), "command line");

    ScratchDir dir;
    const std::string file = write_experiment(dir, c.settings);
    expect_fragments(error_of([&] { load_experiment(file, {}); }),
                     described_keys(c, [&](const std::string& key) { return file_origin(file, c.settings, key); }),
                     "experiment file");

    ExperimentConfig config = default_config_with(c.settings);
    expect_fragments(error_of([&] { validate_experiment(config); }),
                     described_keys(c, [](const std::string&) { return "default value"; }), "default values");
  }
}

TEST(ConfigRules, RelationsNameKeysAndValuesOnTheDirectPath) {
  for (const auto& c : relation_cases()) {
    SCOPED_TRACE(c.rule);
    std::vector<std::string> fragments;
    for (const auto& key : c.named_keys) fragments.push_back(fmt::format("{} ({})", key, value_of(c.settings, key)));
    const ExperimentConfig config = default_config_with(c.settings);
    expect_fragments(error_of([&] { validate_directly(config); }), fragments, "direct");
  }
}

// Every bound and choice list of a rule-owned key, broken on each side it has.
std::vector<Setting> out_of_bounds_settings() {
  std::vector<Setting> settings;
  for (const auto& key : config_schema()) {
    if (!is_rule_owned_key(key)) continue;
    if (key.type == ConfigValueType::Enum) settings.emplace_back(key.name, "bogus");
    const ValueRange& range = key.range;
    if (range.min) settings.emplace_back(key.name, fmt::format("{}", *range.min - (range.min_exclusive ? 0 : 1)));
    if (range.max) settings.emplace_back(key.name, fmt::format("{}", *range.max + (range.max_exclusive ? 0 : 1)));
  }
  return settings;
}

TEST(ConfigRules, EveryBoundIsCheckedOnBothPaths) {
  const std::vector<Setting> settings = out_of_bounds_settings();
  EXPECT_GE(settings.size(), 25u);
  for (const auto& setting : settings) {
    const auto& [key, value] = setting;
    SCOPED_TRACE(key + " = " + value);
    expect_fragments(error_of([&] { load_experiment("", {setting}); }), {"command line", key, value},
                     "command line");
    ScratchDir dir;
    const std::string file = write_experiment(dir, {setting});
    expect_fragments(error_of([&] { load_experiment(file, {}); }), {file + ":1", key, value}, "experiment file");
    ExperimentConfig config = default_config_with({setting});
    expect_fragments(error_of([&] { validate_experiment(config); }), {"default value", key, value}, "default values");
    expect_fragments(error_of([&] { validate_directly(config); }), {key + " must be ", "got ", value}, "direct");
  }
}

// Values on both sides of every bound and relation of the rule-owned keys.
std::vector<std::string> candidate_values(const ConfigKey& key) {
  switch (key.type) {
    case ConfigValueType::Bool: return {"true", "false"};
    case ConfigValueType::Enum: {
      std::vector<std::string> values = key.choices;
      values.push_back("bogus");
      return values;
    }
    case ConfigValueType::Integer: return {"-1", "0", "1", "2", "3", "4", "8", "15", "16", "36", "64"};
    case ConfigValueType::Float: return {"-1", "0", "0.001", "0.5", "1", "2", "4", "16", "nan"};
    case ConfigValueType::String: break;
  }
  ADD_FAILURE() << key.name << " has no candidate values";
  return {};
}

std::string describe_settings(const std::vector<Setting>& settings) {
  std::string text;
  for (const auto& [key, value] : settings) text += fmt::format(" --{} {}", key, value);
  return text;
}

// A rule added on one path only (in the cli's config_validate.cpp, say) shows up as a
// config one path accepts and the other rejects.
TEST(ConfigRules, BothPathsAgreeOnRandomConfigs) {
  std::vector<const ConfigKey*> keys;
  for (const auto& key : config_schema()) {
    // A MoE key drawn alone is nearly always refused (num_experts needs num_experts_per_tok
    // and a CPU device, and the reverse), which would crowd out the other relations; their
    // rules are checked in ModelMoe.ConfigRules and their bounds above.
    if (std::string_view(key.name).starts_with("model.num_experts") || key.name == "model.router_aux_loss_coef")
      continue;
    // Likewise the other MoE keys (each needs model.num_experts), Multi-head Latent
    // Attention's (each needs model.kv_lora_rank, which needs them) and YaRN's:
    // ModelDeepseek.ConfigRules checks their relations.
    const bool moe_or_mla = std::ranges::any_of(
        std::vector<std::string_view>{"model.moe_", "model.num_shared_experts", "model.first_dense_layers",
                                      "model.router_", "model.q_lora_rank", "model.kv_lora_rank", "model.qk_",
                                      "model.v_head_dim", "model.rope_scaling.beta_", "model.rope_scaling.mscale"},
        [&](std::string_view prefix) { return std::string_view(key.name).starts_with(prefix); });
    // optimizer.master_dtype bf16 is a FLUX run's (the cli refuses it for a language model,
    // FluxBf16Master.RefusedWhereItIsNotBuilt), a relation to flux.model the rules cannot see.
    if (key.name == "optimizer.master_dtype") continue;
    if (!moe_or_mla && is_rule_owned_key(key)) keys.push_back(&key);
  }
  std::mt19937_64 random(20240611);
  int rejected = 0;
  constexpr int kTrials = 1500;
  for (int trial = 0; trial < kTrials; ++trial) {
    // seq_len 1 and a CUDA device keep the cli's own relations (seq_len within max_seq_len,
    // bf16 optimizer state on CUDA) out of the comparison.
    std::vector<Setting> settings = {{"training.seq_len", "1"}, {"training.device", "cuda"}};
    for (const ConfigKey* key : keys) {
      if (random() % 8 != 0) continue;
      const std::vector<std::string> values = candidate_values(*key);
      settings.emplace_back(key->name, values[random() % values.size()]);
    }
    const std::string cli = error_of([&] { load_experiment("", ConfigOverrides(settings.begin(), settings.end())); });
    const std::string direct = error_of([&] { validate_directly(default_config_with(settings)); });
    ASSERT_EQ(cli.empty(), direct.empty()) << describe_settings(settings) << "\ncli: " << cli
                                           << "\ndirect: " << direct;
    if (cli.empty()) continue;
    ++rejected;
    EXPECT_NE(cli.find("command line"), std::string::npos) << describe_settings(settings) << "\ncli: " << cli;
  }
  EXPECT_GT(rejected, kTrials / 4);
  EXPECT_LT(rejected, kTrials * 3 / 4);
}

TEST(ConfigRules, MessagesOnBothPaths) {
  const ExperimentConfig tiny = load_experiment("", {});
  ModelConfig model = tiny.model;
  model.num_kv_heads = 3;
  EXPECT_EQ(error_of([&] { model.validate(); }), "model.num_heads (4) must be divisible by model.num_kv_heads (3)");
  const std::string cli = error_of([] { load_experiment("", {{"model.num_kv_heads", "3"}}); });
  EXPECT_TRUE(cli.starts_with("model.num_heads = 4 (")) << cli;
  EXPECT_TRUE(cli.ends_with("debug-tiny.yaml:7) must be divisible by model.num_kv_heads = 3 (command line)")) << cli;

  OptimizerConfig opt = tiny.optimizer;
  LRSchedulerConfig sched = tiny.lr_scheduler;
  sched.min_lr = 0.01;
  EXPECT_EQ(error_of([&] { validate(opt, sched, 10); }),
            "lr_scheduler.min_lr (0.01) must not exceed optimizer.lr (0.005)");
  EXPECT_EQ(error_of([] { load_experiment("", {{"lr_scheduler.min_lr", "0.01"}}); }),
            "lr_scheduler.min_lr = 0.01 (command line) must not exceed optimizer.lr = 0.005 (default value)");
}

}  // namespace
}  // namespace forge
