// load_experiment: the shipped model and experiment files, precedence of the sources, the
// model file search, and the errors for files that are missing or malformed.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "cli/config.h"
#include "cli/config_model_files.h"
#include "config_test_support.h"
#include "core/error.h"
#include "model/memory_estimate.h"
#include "train/memory_check.h"

namespace forge {
namespace {

using config_test::expect_error;
using config_test::ScopedEnv;
using config_test::ScratchDir;
using config_test::source_path;

ExperimentConfig load_model(const std::string& name) { return load_experiment("", {{"model.name", name}}); }

TEST(ConfigLoad, EveryShippedModelFileLoadsAndValidates) {
  ScopedEnv no_config_dir("FORGE_CONFIG_DIR", std::nullopt);
  int models = 0;
  for (const auto& entry : std::filesystem::directory_iterator(source_path("configs/models"))) {
    const std::string name = entry.path().stem().string();
    SCOPED_TRACE(name);
    const ExperimentConfig config = load_model(name);
    EXPECT_EQ(config.model.name, name);
    ++models;
  }
  EXPECT_GE(models, 13);
}

TEST(ConfigLoad, ModelFilesHoldTheHuggingFaceArchitectures) {
  const ModelConfig llama8b = load_model("llama3.1-8b").model;
  EXPECT_EQ(llama8b.vocab_size, 128256);
  EXPECT_EQ(llama8b.hidden_size, 4096);
  EXPECT_EQ(llama8b.num_layers, 32);
  EXPECT_EQ(llama8b.num_heads, 32);
  EXPECT_EQ(llama8b.num_kv_heads, 8);
  EXPECT_EQ(llama8b.ffn_hidden_size, 14336);
  EXPECT_EQ(llama8b.rope_theta, 500000.0);
  EXPECT_TRUE(llama8b.rope_scaling.enabled);
  EXPECT_EQ(llama8b.rope_scaling.factor, 8.0);
  EXPECT_EQ(llama8b.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(llama8b.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(llama8b.rope_scaling.original_max_position, 8192);
  EXPECT_EQ(llama8b.max_seq_len, 131072);
  EXPECT_EQ(llama8b.norm_eps, 1e-5);
  EXPECT_FALSE(llama8b.tie_word_embeddings);

  const ModelConfig llama405b = load_model("llama3.1-405b").model;
  EXPECT_EQ(llama405b.hidden_size, 16384);
  EXPECT_EQ(llama405b.num_layers, 126);
  EXPECT_EQ(llama405b.num_heads, 128);
  EXPECT_EQ(llama405b.ffn_hidden_size, 53248);

  const ModelConfig llama1b = load_model("llama3.2-1b").model;
  EXPECT_EQ(llama1b.hidden_size, 2048);
  EXPECT_EQ(llama1b.num_layers, 16);
  EXPECT_EQ(llama1b.head_dim, 64);
  EXPECT_EQ(llama1b.ffn_hidden_size, 8192);
  EXPECT_EQ(llama1b.rope_scaling.factor, 32.0);
  EXPECT_TRUE(llama1b.tie_word_embeddings);

  const ModelConfig llama3b = load_model("llama3.2-3b").model;
  EXPECT_EQ(llama3b.num_heads, 24);
  EXPECT_EQ(llama3b.num_layers, 28);
  EXPECT_EQ(llama3b.head_dim, 128);

  const ModelConfig llama2_13b = load_model("llama2-13b").model;
  EXPECT_EQ(llama2_13b.vocab_size, 32000);
  EXPECT_EQ(llama2_13b.hidden_size, 5120);
  EXPECT_EQ(llama2_13b.num_kv_heads, 40);
  EXPECT_EQ(llama2_13b.ffn_hidden_size, 13824);
  EXPECT_EQ(llama2_13b.max_seq_len, 4096);
  EXPECT_FALSE(llama2_13b.rope_scaling.enabled);
  EXPECT_EQ(llama2_13b.rope_theta, 10000.0);

  const ModelConfig mistral = load_model("mistral-7b-v0.1").model;
  EXPECT_EQ(mistral.sliding_window, 4096);
  EXPECT_EQ(mistral.max_seq_len, 32768);
  EXPECT_EQ(mistral.num_kv_heads, 8);

  EXPECT_EQ(load_model("debug-tiny-swa").model.sliding_window, 16);
  const ModelConfig mha = load_model("debug-tiny-mha").model;
  EXPECT_EQ(mha.num_kv_heads, mha.num_heads);
}

TEST(ConfigLoad, ShippedExperimentsLoad) {
  const ExperimentConfig proxy = load_experiment(source_path("configs/experiments/h100/llama3.1-8b-proxy.yaml"), {});
  EXPECT_EQ(proxy.model.name, "llama3.1-8b");
  EXPECT_EQ(proxy.model.num_layers, 4);
  EXPECT_EQ(proxy.model.hidden_size, 4096);
  EXPECT_EQ(proxy.training.seq_len, 8192);
  EXPECT_EQ(proxy.training.local_batch_size, 1);
  EXPECT_EQ(proxy.data.source, "mock");
  EXPECT_EQ(proxy.precision.compute_dtype, "bf16");
  EXPECT_EQ(proxy.training.device, "cuda");

  const ExperimentConfig tiny = load_experiment(source_path("configs/experiments/debug-tiny.yaml"), {});
  EXPECT_EQ(to_yaml(tiny), to_yaml(load_experiment("", {})))
      << "configs/experiments/debug-tiny.yaml must spell out exactly the built-in defaults";
}

// The FP8 convergence baseline (scripts/fp8-convergence) is a CUDA bf16 run of llama-150m on
// the prepared web-bible corpus; its FP8 variants are the same file with precision.fp8 set on
// the command line, so the FP8 rules (widths and tokens per micro-batch multiples of 16) must
// accept it as it stands.
TEST(ConfigLoad, Fp8ConvergenceExperimentTakesTheFp8Recipes) {
  const std::string file = source_path("configs/experiments/fp8-convergence/llama-150m-web-bible.yaml");
  const ExperimentConfig base = load_experiment(file, {});
  EXPECT_EQ(base.model.name, "llama-150m");
  EXPECT_EQ(base.model.vocab_size, 8192);
  EXPECT_EQ(base.data.source, "indexed");
  EXPECT_EQ(base.training.device, "cuda");
  EXPECT_EQ(base.precision.compute_dtype, "bf16");
  EXPECT_EQ(base.precision.fp8, "none");
  EXPECT_EQ(base.training.steps, 2000);
  const ExperimentConfig fp8 = load_experiment(file, {{"precision.fp8", "tensorwise"}});
  EXPECT_EQ(fp8.precision.fp8, "tensorwise");
  ExperimentConfig same = fp8;
  same.precision.fp8 = "none";
  EXPECT_EQ(to_yaml(same), to_yaml(base)) << "the FP8 run must differ from the baseline in precision.fp8 only";
}

// Every experiment shipped under configs/experiments/ (the benchmark presets included) must
// load and validate, as `forge info FILE` does, so a broken preset fails CI. A preset in a
// folder named after a GPU must also be a bf16 CUDA run whose per-rank memory estimate
// (forge info's "one GPU" line) plus forge's reserve fits that GPU's usable memory.
TEST(ConfigLoad, EveryShippedExperimentLoadsAndFitsItsGpu) {
  ScopedEnv no_config_dir("FORGE_CONFIG_DIR", std::nullopt);
  constexpr double gib = 1024.0 * 1024 * 1024;
  const std::map<std::string, double> usable_gib = {{"h100", 79.2}, {"h200", 139.8}};  // H100 SXM 80GB, H200 141GB
  int experiments = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(source_path("configs/experiments"))) {
    if (!entry.is_regular_file() || entry.path().extension() != ".yaml") continue;
    const std::string file = entry.path().string();
    SCOPED_TRACE(file);
    ++experiments;
    ExperimentConfig config;
    try {
      config = load_experiment(file, {});
    } catch (const Error& error) {
      ADD_FAILURE() << error.what();
      continue;
    }
    const TrainingConfig& t = config.training;
    const ParallelismConfig& p = config.parallelism;
    EXPECT_EQ(t.global_batch_size, t.local_batch_size * t.gradient_accumulation_steps *
                                       p.data_parallel_shard_degree * p.data_parallel_replicate_degree);
    const auto gpu = usable_gib.find(entry.path().parent_path().filename().string());
    if (gpu == usable_gib.end()) continue;
    EXPECT_EQ(t.device, "cuda");
    EXPECT_EQ(config.precision.compute_dtype, "bf16");
    MemoryPlan plan = memory_plan_of(config);
    plan.cuda = true;
    const double need_gib = (estimate_memory(config.model, plan).total() + kReserveBytes) / gib;
    EXPECT_LE(need_gib, gpu->second) << "estimate plus reserve does not fit " << gpu->first;
  }
  EXPECT_GE(experiments, 14);
}

TEST(ConfigLoad, DefaultIsTheTinyModelOnSyntheticData) {
  const ExperimentConfig config = load_experiment("", {});
  EXPECT_EQ(config.model.name, "debug-tiny");
  EXPECT_EQ(config.data.source, "synthetic");
  EXPECT_EQ(config.model.vocab_size, 32);
}

class ConfigLoadFiles : public ::testing::Test {
 protected:
  ScratchDir dir;
  ScopedEnv no_config_dir{"FORGE_CONFIG_DIR", std::nullopt};

  void SetUp() override {
    dir.write("configs/models/base.yaml",
              "# test model\n"
              "vocab_size: 100\nhidden_size: 32\nnum_layers: 2\nnum_heads: 4\nnum_kv_heads: 2\n"
              "ffn_hidden_size: 64\nmax_seq_len: 64\n");
    dir.write("configs/models/wide.yaml",
              "vocab_size: 100\nhidden_size: 64\nnum_layers: 3\nnum_heads: 4\nnum_kv_heads: 4\n"
              "ffn_hidden_size: 128\nmax_seq_len: 64\n");
  }
};

TEST_F(ConfigLoadFiles, PrecedenceIsModelFileThenExperimentThenCommandLine) {
  const std::string experiment = dir.write("runs/exp.yaml",
                                           "model:\n  name: base\n  num_layers: 5\n  hidden_size: 48\n"
                                           "training:\n  seq_len: 32\n  steps: 7\n");
  const ExperimentConfig config = load_experiment(experiment, {{"training.steps", "9"}, {"model.num_layers", "6"}});
  EXPECT_EQ(config.model.name, "base");
  EXPECT_EQ(config.model.vocab_size, 100);  // model file
  EXPECT_EQ(config.model.hidden_size, 48);  // experiment over model file
  EXPECT_EQ(config.model.num_layers, 6);    // command line over both
  EXPECT_EQ(config.training.seq_len, 32);   // experiment over default
  EXPECT_EQ(config.training.steps, 9);      // command line over experiment
  EXPECT_EQ(config.optimizer.lr, ExperimentConfig{}.optimizer.lr);  // default
}

TEST_F(ConfigLoadFiles, ModelNameOnTheCommandLineSelectsTheModelFile) {
  const std::string experiment =
      dir.write("exp.yaml", "model:\n  name: base\n  num_layers: 5\ntraining:\n  seq_len: 32\n");
  const ExperimentConfig config =
      load_experiment(experiment, {{"model.num_kv_heads", "1"}, {"model.name", "wide"}});
  EXPECT_EQ(config.model.name, "wide");
  EXPECT_EQ(config.model.hidden_size, 64);   // from wide.yaml
  EXPECT_EQ(config.model.num_layers, 5);     // the experiment's model keys still apply
  EXPECT_EQ(config.model.num_kv_heads, 1);   // applied after the model file although listed first
}

TEST_F(ConfigLoadFiles, ConfigDirEnvironmentVariableComesFirst) {
  ScratchDir other;
  other.write("models/base.yaml",
              "vocab_size: 7\nhidden_size: 32\nnum_layers: 1\nnum_heads: 4\nnum_kv_heads: 2\n"
              "ffn_hidden_size: 64\nmax_seq_len: 64\n");
  const std::string experiment = dir.write("exp.yaml", "model:\n  name: base\ntraining:\n  seq_len: 32\n");
  EXPECT_EQ(load_experiment(experiment, {}).model.vocab_size, 100);
  ScopedEnv config_dir("FORGE_CONFIG_DIR", other.path().string());
  EXPECT_EQ(load_experiment(experiment, {}).model.vocab_size, 7);
  EXPECT_EQ(model_search_dirs(experiment).front(), other.path() / "models");
}

TEST_F(ConfigLoadFiles, NestedAndDottedRopeScalingKeys) {
  const std::string experiment = dir.write("exp.yaml",
                                           "model:\n  name: base\n  rope_scaling:\n    enabled: true\n    factor: 4\n"
                                           "training:\n  seq_len: 32\n");
  const ExperimentConfig config = load_experiment(experiment, {{"model.rope_scaling.low_freq_factor", "2"}});
  EXPECT_TRUE(config.model.rope_scaling.enabled);
  EXPECT_EQ(config.model.rope_scaling.factor, 4.0);
  EXPECT_EQ(config.model.rope_scaling.low_freq_factor, 2.0);
}

TEST_F(ConfigLoadFiles, UnknownKeyNamesFileLineAndSuggestion) {
  const std::string experiment =
      dir.write("exp.yaml", "model:\n  name: base\ntraining:\n  seq_len: 32\n  local_batch_sise: 4\n");
  expect_error([&] { load_experiment(experiment, {}); },
               {"unknown key 'training.local_batch_sise'", "exp.yaml:5", "did you mean 'training.local_batch_size'?"});
  const std::string unknown_section = dir.write("section.yaml", "trainig:\n  steps: 3\n");
  expect_error([&] { load_experiment(unknown_section, {}); },
               {"unknown key 'trainig'", "section.yaml:1", "did you mean 'training'?"});
  const std::string nested = dir.write("nested.yaml", "model:\n  rope_scaling:\n    factr: 2\n");
  expect_error([&] { load_experiment(nested, {}); },
               {"unknown key 'model.rope_scaling.factr'", "nested.yaml:3",
                "did you mean 'model.rope_scaling.factor'?"});
}

TEST_F(ConfigLoadFiles, UnknownOverrideKeySuggestsTheKnownOne) {
  expect_error([] { load_experiment("", {{"training.stpes", "3"}}); },
               {"command line", "unknown key 'training.stpes'", "did you mean 'training.steps'?"});
  expect_error([] { load_experiment("", {{"model.rope_scaling", "8"}}); },
               {"command line", "'model.rope_scaling' is a group of keys"});
}

// A comma-separated key (is_comma_list_key) takes a YAML list too, as torchtitan's TOML
// lists: its items joined with commas; an item that is no single name is refused by line.
TEST_F(ConfigLoadFiles, CommaListKeysTakeYamlLists) {
  const std::string listed = dir.write("listed.yaml",
                                       "precision:\n  fp8: tensorwise\n  fp8_filter_fqns: [layers.0., mlp.down]\n"
                                       "lora:\n  rank: 4\n  target_modules:\n    - q_proj\n    - o_proj\n");
  const ExperimentConfig config = load_experiment(listed, {});
  EXPECT_EQ(config.precision.fp8_filter_fqns, "layers.0.,mlp.down");
  EXPECT_EQ(config.lora.target_modules, "q_proj,o_proj");
  const std::string nested = dir.write("nested.yaml", "precision:\n  fp8: tensorwise\n  fp8_filter_fqns: [a, [b]]\n");
  expect_error([&] { load_experiment(nested, {}); },
               {"nested.yaml:3", "precision.fp8_filter_fqns item 1 must be one name without commas", "got a list"});
  const std::string comma = dir.write("comma.yaml", "lora:\n  target_modules: ['q_proj,v_proj']\n");
  expect_error([&] { load_experiment(comma, {}); }, {"comma.yaml:2", "lora.target_modules item 0", "'q_proj,v_proj'"});
}

TEST_F(ConfigLoadFiles, WrongTypeInYamlNamesFileLineAndKey) {
  const std::string experiment = dir.write("exp.yaml", "training:\n  steps: ten\n");
  expect_error([&] { load_experiment(experiment, {}); },
               {"exp.yaml:2", "training.steps expects an integer", "got 'ten'"});
  const std::string list = dir.write("list.yaml", "training:\n  steps: [1, 2]\n");
  expect_error([&] { load_experiment(list, {}); }, {"list.yaml:2", "training.steps expects an integer", "got a list"});
  const std::string empty_value = dir.write("empty.yaml", "training:\n  steps:\n");
  expect_error([&] { load_experiment(empty_value, {}); }, {"empty.yaml:2", "training.steps expects an integer"});
  expect_error([] { load_experiment("", {{"training.steps", "ten"}}); },
               {"command line", "training.steps expects an integer", "got 'ten'"});
}

TEST_F(ConfigLoadFiles, ErrorsInTheModelFileNameTheModelFile) {
  dir.write("configs/models/broken.yaml", "vocab_size: 100\nhidden_sise: 32\n");
  dir.write("configs/models/named.yaml", "name: other\n");
  const std::string broken = dir.write("broken-exp.yaml", "model:\n  name: broken\n");
  expect_error([&] { load_experiment(broken, {}); },
               {"broken.yaml:2", "unknown key 'model.hidden_sise'", "did you mean 'model.hidden_size'?"});
  const std::string named = dir.write("named-exp.yaml", "model:\n  name: named\n");
  expect_error([&] { load_experiment(named, {}); }, {"named.yaml:1", "model.name cannot be set in a model file"});
}

TEST_F(ConfigLoadFiles, MissingExperimentFile) {
  expect_error([&] { load_experiment((dir.path() / "x.yaml").string(), {}); },
               {"experiment file '", "x.yaml' not found"});
}

TEST_F(ConfigLoadFiles, MissingModelListsWhereItLookedAndWhatExists) {
  const std::string experiment = dir.write("exp.yaml", "model:\n  name: llama9\n");
  expect_error([&] { load_experiment(experiment, {}); },
               {"exp.yaml:2", "model 'llama9' not found", "looked in", (dir.path() / "configs/models").string(),
                "available: base, ", "wide"});
  expect_error([] { load_experiment("", {{"model.name", "lama3.1-8b"}}); },
               {"command line", "model 'lama3.1-8b' not found", "did you mean 'llama3.1-8b'?", "llama2-70b"});
}

TEST_F(ConfigLoadFiles, MalformedYamlShapes) {
  const std::string not_a_map = dir.write("list.yaml", "- model\n- training\n");
  expect_error([&] { load_experiment(not_a_map, {}); }, {"list.yaml:1", "expected a map of sections", "got a list"});
  const std::string scalar_section = dir.write("scalar.yaml", "training: 5\n");
  expect_error([&] { load_experiment(scalar_section, {}); },
               {"scalar.yaml:1", "training is a group of keys", "got '5'"});
  const std::string duplicate = dir.write("dup.yaml", "training:\n  steps: 3\n  seq_len: 8\n  steps: 4\n");
  expect_error([&] { load_experiment(duplicate, {}); },
               {"dup.yaml:4", "duplicate key 'training.steps'", "first set at line 2"});
  const std::string duplicate_section = dir.write("dupsec.yaml", "eval:\n  steps: 3\neval:\n  interval: 4\n");
  expect_error([&] { load_experiment(duplicate_section, {}); }, {"dupsec.yaml:3", "duplicate key 'eval'"});
  const std::string invalid = dir.write("invalid.yaml", "training:\n  steps: [1, 2\n");
  expect_error([&] { load_experiment(invalid, {}); }, {"invalid.yaml:", "invalid YAML"});
}

TEST_F(ConfigLoadFiles, EmptyExperimentFileMeansDefaults) {
  const std::string empty = dir.write("empty.yaml", "# nothing\n");
  EXPECT_EQ(to_yaml(load_experiment(empty, {})), to_yaml(load_experiment("", {})));
}

}  // namespace
}  // namespace forge
