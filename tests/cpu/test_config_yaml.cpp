// to_yaml: complete, ordered, readable, and a faithful round trip through load_experiment;
// and the compiled-in default model agrees with configs/models/debug-tiny.yaml.
#include <gtest/gtest.h>

#include "cli/config.h"
#include "cli/config_defaults.h"
#include "cli/config_schema.h"
#include "config_test_support.h"

namespace forge {
namespace {

using config_test::ScratchDir;
using config_test::ScopedEnv;
using config_test::source_path;

// Every key's value, formatted: two configs are equal when these are.
std::vector<std::pair<std::string, std::string>> all_values(const ExperimentConfig& config) {
  std::vector<std::pair<std::string, std::string>> values;
  for (const auto& key : config_schema()) values.emplace_back(key.name, format_config_value(key, config));
  return values;
}

ExperimentConfig round_trip(const ExperimentConfig& config) {
  ScratchDir dir;
  return load_experiment(dir.write("config.yaml", to_yaml(config)), {});
}

TEST(ConfigYaml, ListsEverySectionAndKeyInOrder) {
  const std::string yaml = to_yaml(load_experiment("", {}));
  std::size_t position = 0;
  for (const auto& section : config_sections()) {
    const auto found = yaml.find("\n" + section + ":\n", position);
    ASSERT_NE(found, std::string::npos) << section;
    position = found;
  }
  EXPECT_NE(yaml.find("\n  rope_scaling:\n    enabled: false"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("  local_batch_size: 8"), std::string::npos);
  EXPECT_NE(yaml.find("# micro-batch size per device"), std::string::npos);
  EXPECT_NE(yaml.find("(cosine | linear | constant)"), std::string::npos);
  for (const auto& key : config_schema()) {
    const std::string leaf = key.name.substr(key.name.rfind('.') + 1);
    EXPECT_NE(yaml.find(" " + leaf + ": "), std::string::npos) << key.name;
  }
}

TEST(ConfigYaml, RoundTripsTheDefault) {
  const ExperimentConfig config = load_experiment("", {});
  EXPECT_EQ(all_values(round_trip(config)), all_values(config));
}

TEST(ConfigYaml, RoundTripsEveryKindOfValue) {
  const ExperimentConfig config = load_experiment(
      source_path("configs/experiments/h100/llama3.1-8b-proxy.yaml"),
      {{"optimizer.lr", "0.000123456789"}, {"optimizer.eps", "1e-12"}, {"model.norm_eps", "3e-7"},
       {"training.seed", "18446744073709551615"}, {"data.path", "/data/with space/and \"quotes\": x"},
       {"logging.run_dir", "123"}, {"data.source", "indexed"}, {"model.tie_word_embeddings", "true"},
       {"training.global_batch_size", "8"}, {"training.gradient_accumulation_steps", "8"},
       {"model.rope_scaling.factor", "2.5"}, {"lr_scheduler.decay_style", "linear"}});
  const ExperimentConfig again = round_trip(config);
  EXPECT_EQ(all_values(again), all_values(config));
  EXPECT_EQ(again.data.path, "/data/with space/and \"quotes\": x");
  EXPECT_EQ(again.logging.run_dir, "123");
  EXPECT_EQ(again.optimizer.lr, 0.000123456789);
  EXPECT_EQ(again.training.seed, 18446744073709551615ull);
  EXPECT_EQ(to_yaml(again), to_yaml(config));
}

TEST(ConfigYaml, CompiledInTinyModelMatchesYaml) {
  ScopedEnv no_config_dir("FORGE_CONFIG_DIR", std::nullopt);
  ExperimentConfig compiled_in;
  compiled_in.model = debug_tiny_model();
  const ExperimentConfig from_file = load_experiment("", {{"model.name", kDefaultModelName}});
  for (const auto& key : config_schema()) {
    if (key.name.starts_with("model.")) {
      EXPECT_EQ(format_config_value(key, from_file), format_config_value(key, compiled_in)) << key.name;
    }
  }
}

TEST(ConfigYaml, KeysHelpListsEveryKeyWithDefault) {
  const std::string help = describe_keys();
  for (const auto& key : config_schema()) EXPECT_NE(help.find("--" + key.name + " <"), std::string::npos) << key.name;
  EXPECT_NE(help.find("--training.steps <an integer >= 1>  (default 300)"), std::string::npos) << help;
}

}  // namespace
}  // namespace forge
