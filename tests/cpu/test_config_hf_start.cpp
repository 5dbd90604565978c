// checkpoint.initial_load_path naming a Hugging Face model directory (NOTE [A Hugging Face
// directory is the model file] in cli/config_hf_model.h): the architecture and name come
// from config.json, only real conflicts are refused, and a path that is neither a forge
// checkpoint nor a Hugging Face model is refused saying what it holds.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/hf_export.h"
#include "cli/config.h"
#include "config_test_support.h"
#include "model/parameters.h"

namespace forge {
namespace {

using config_test::expect_error;
using config_test::ScratchDir;
using nlohmann::json;

ModelConfig small_mistral() {
  ModelConfig m;
  m.vocab_size = 40;
  m.hidden_size = 16;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.ffn_hidden_size = 24;
  m.norm_eps = 1e-6;
  m.rope_theta = 500000;
  m.max_seq_len = 96;
  m.sliding_window = 8;
  return m;
}

class ConfigHfStart : public ::testing::Test {
 protected:
  // A Hugging Face model directory <scratch>/<name> of `model`, with `edit` applied to its config.json.
  std::string hf_dir(const std::string& name, const ModelConfig& model, const std::function<void(json&)>& edit = {}) {
    const std::string path = (dir.path() / name).string();
    save_hf_model(path, FlatParameters(model), {.dtype = SafetensorsDType::BF16});
    if (edit) {
      json config = json::parse(std::ifstream(path + "/config.json"));
      edit(config);
      std::ofstream(path + "/config.json") << config.dump();
    }
    return path;
  }
  ScratchDir dir;
};

TEST_F(ConfigHfStart, TheDirectoryAloneSetsTheModelAndItsName) {
  const std::string model_dir = hf_dir("Mistral-Tiny-v0.3", small_mistral());
  const ExperimentConfig config = load_experiment("", {{"checkpoint.initial_load_path", model_dir}});
  EXPECT_EQ(config.model.name, "Mistral-Tiny-v0.3");
  EXPECT_EQ(config.model.vocab_size, 40);
  EXPECT_EQ(config.model.num_kv_heads, 2);
  EXPECT_EQ(config.model.rope_theta, 500000);
  EXPECT_EQ(config.model.norm_eps, 1e-6);
  EXPECT_EQ(config.model.sliding_window, 8);
  EXPECT_EQ(config.model.max_seq_len, 96);
  EXPECT_TRUE(config.checkpoint.initial_load_in_hf);
  EXPECT_EQ(config.checkpoint.export_dtype, "bf16");  // config.json's dtype
  EXPECT_EQ(config.training.seq_len, 96);              // the default 128, cut to max_position_embeddings
}

TEST_F(ConfigHfStart, HubCacheSnapshotsAreNamedAfterTheRepository) {
  const std::string model_dir = hf_dir("models--meta-llama--Llama-3.2-1B/snapshots/0123abcd", small_mistral());
  EXPECT_EQ(load_experiment("", {{"checkpoint.initial_load_path", model_dir + "/"}}).model.name, "Llama-3.2-1B");
}

TEST_F(ConfigHfStart, ExplicitEqualValuesAreAcceptedAndTheResolvedYamlRunsAgain) {
  const std::string model_dir = hf_dir("m", small_mistral());
  const std::string experiment = dir.write(
      "exp.yaml", "model:\n  name: my-finetune\n  num_layers: 2\n  head_dim: 4\n  rope_scaling:\n    factor: 2\n"
                  "  init_std: 0.5\ncheckpoint:\n  initial_load_path: " + model_dir + "\n  initial_load_in_hf: true\n"
                  "training:\n  seq_len: 32\n");
  const ExperimentConfig config = load_experiment(experiment, {{"model.sliding_window", "8"}});
  EXPECT_EQ(config.model.name, "my-finetune");  // names the run; no configs/models/my-finetune.yaml is read
  EXPECT_EQ(config.model.init_std, 0.5);        // not architecture
  const std::string again = dir.write("again.yaml", to_yaml(config));
  EXPECT_EQ(to_yaml(load_experiment(again, {})), to_yaml(config));
}

TEST_F(ConfigHfStart, ConflictsNameTheKeyBothValuesAndTheFile) {
  const std::string model_dir = hf_dir("m", small_mistral());
  const std::string experiment =
      dir.write("exp.yaml", "model:\n  num_layers: 3\ncheckpoint:\n  initial_load_path: " + model_dir + "\n");
  expect_error([&] { load_experiment(experiment, {}); },
               {"exp.yaml:2", "model.num_layers = 3", model_dir + "/config.json", "num_hidden_layers", "gives 2"});
  expect_error([&] {
    load_experiment("", {{"checkpoint.initial_load_path", model_dir}, {"model.max_seq_len", "4096"}});
  }, {"command line", "model.max_seq_len = 4096", "max_position_embeddings", "gives 96",
      "training.allow_longer_seq_len"});
  expect_error([&] {
    load_experiment("", {{"checkpoint.initial_load_path", model_dir}, {"model.rope_scaling.enabled", "true"}});
  }, {"model.rope_scaling.enabled = true", "gives false"});
}

// A DeepSeek directory sets DeepSeek's keys, and a conflict names DeepSeek's config.json key.
TEST_F(ConfigHfStart, DeepseekConflictsNameDeepseeksKeys) {
  ModelConfig tiny = load_experiment("", {{"model.name", "debug-tiny-mla"}}).model;
  tiny.rope_scaling = {.enabled = true, .factor = 4.0, .original_max_position = 64, .type = "yarn", .mscale_all_dim = 1.0};
  const std::string model_dir = hf_dir("DeepSeek-Tiny", tiny);
  const ExperimentConfig config = load_experiment("", {{"checkpoint.initial_load_path", model_dir}});
  EXPECT_EQ(config.model.kv_lora_rank, 32);
  EXPECT_EQ(config.model.num_shared_experts, 1);
  EXPECT_EQ(config.model.first_dense_layers, 1);
  EXPECT_EQ(config.model.rope_scaling.type, "yarn");
  EXPECT_EQ(config.model.rope_scaling.mscale_all_dim, 1.0);
  expect_error([&] {
    load_experiment("", {{"checkpoint.initial_load_path", model_dir}, {"model.num_experts", "4"}});
  }, {"model.num_experts = 4", "(n_routed_experts) gives 8"});
  expect_error([&] {
    load_experiment("", {{"checkpoint.initial_load_path", model_dir}, {"model.num_shared_experts", "2"}});
  }, {"model.num_shared_experts = 2", "(n_shared_experts) gives 1"});
  expect_error([&] {
    load_experiment("", {{"checkpoint.initial_load_path", model_dir}, {"model.rope_scaling.mscale_all_dim", "0.5"}});
  }, {"model.rope_scaling.mscale_all_dim = 0.5", "(rope_scaling.mscale_all_dim) gives 1"});
  // Llama 3.1's keys are not YaRN's: an equal default is no conflict either way.
  load_experiment("", {{"checkpoint.initial_load_path", model_dir}, {"model.rope_scaling.low_freq_factor", "2"}});
}

TEST_F(ConfigHfStart, LongerSequencesOnlyWhenAsked) {
  const std::string model_dir = hf_dir("m", small_mistral());
  expect_error([&] {
    load_experiment("", {{"checkpoint.initial_load_path", model_dir}, {"training.seq_len", "128"}});
  }, {"training.seq_len = 128 (command line) exceeds model.max_seq_len = 96", "training.allow_longer_seq_len true"});
  const ExperimentConfig config = load_experiment("", {{"checkpoint.initial_load_path", model_dir},
                                                       {"training.seq_len", "128"},
                                                       {"training.allow_longer_seq_len", "true"}});
  EXPECT_EQ(config.training.seq_len, 128);
  EXPECT_EQ(config.model.max_seq_len, 96);
}

TEST_F(ConfigHfStart, ExportDtypeDefaultsToTheSourcesAndCanBeChosen) {
  const std::string declared = hf_dir("fp16", small_mistral(), [](json& c) { c["dtype"] = "float16"; });
  EXPECT_EQ(load_experiment("", {{"checkpoint.initial_load_path", declared}}).checkpoint.export_dtype, "fp16");
  const std::string legacy = hf_dir("legacy", small_mistral(), [](json& c) {
    c.erase("dtype");
    c["torch_dtype"] = "float32";
  });
  EXPECT_EQ(load_experiment("", {{"checkpoint.initial_load_path", legacy}}).checkpoint.export_dtype, "fp32");
  const std::string undeclared = hf_dir("undeclared", small_mistral(), [](json& c) {
    c.erase("dtype");
    c.erase("torch_dtype");
  });
  EXPECT_EQ(load_experiment("", {{"checkpoint.initial_load_path", undeclared}}).checkpoint.export_dtype,
            "bf16");  // the stored weights'
  EXPECT_EQ(load_experiment("", {{"checkpoint.initial_load_path", declared}, {"checkpoint.export_dtype", "fp32"}})
                .checkpoint.export_dtype,
            "fp32");
  EXPECT_EQ(load_experiment("", {}).checkpoint.export_dtype, "bf16");  // from scratch
  expect_error([&] { load_experiment("", {{"checkpoint.export_dtype", "int8"}}); },
               {"checkpoint.export_dtype expects one of auto, bf16, fp16, fp32"});
}

TEST_F(ConfigHfStart, ExplicitInitialLoadInHf) {
  const std::string model_dir = hf_dir("m", small_mistral());
  EXPECT_EQ(load_experiment("", {{"checkpoint.initial_load_in_hf", "true"}, {"checkpoint.initial_load_path", model_dir}})
                .model.vocab_size,
            40);
  expect_error([&] {
    load_experiment("", {{"checkpoint.initial_load_path", model_dir}, {"checkpoint.initial_load_in_hf", "false"}});
  }, {"checkpoint.initial_load_in_hf is false", "is a Hugging Face model directory"});
  expect_error([&] {
    load_experiment("", {{"checkpoint.initial_load_in_hf", "true"},
                         {"checkpoint.initial_load_path", (dir.path() / "absent").string()}});
  }, {"absent/config.json: not found"});
}

TEST_F(ConfigHfStart, APathThatIsNeitherSaysWhatItHoldsAndWhatWasExpected) {
  dir.write("stuff/notes.txt", "x");
  dir.write("stuff/weights.bin", "x");
  expect_error([&] { load_experiment("", {{"checkpoint.initial_load_path", (dir.path() / "stuff").string()}}); },
               {"checkpoint.initial_load_path (command line)", "neither a forge checkpoint nor a Hugging Face model",
                "no metadata.json and no config.json", "holds notes.txt, weights.bin",
                "expected a forge checkpoint", "config.json with model.safetensors"});
  const std::string file = dir.write("file.txt", "x");
  expect_error([&] { load_experiment("", {{"checkpoint.initial_load_path", file}}); }, {"is not a directory"});
}

TEST_F(ConfigHfStart, ForgeCheckpointsAndAbsentPathsKeepTheModelFile) {
  dir.write("ckpts/step-10/metadata.json", "{}");
  const ExperimentConfig config =
      load_experiment("", {{"checkpoint.initial_load_path", (dir.path() / "ckpts").string()}});
  EXPECT_EQ(config.model.name, "debug-tiny");
  EXPECT_FALSE(config.checkpoint.initial_load_in_hf);
  // An absent path is the trainer's to report (a resumed run never reads it).
  EXPECT_EQ(load_experiment("", {{"checkpoint.initial_load_path", (dir.path() / "gone").string()}}).model.name,
            "debug-tiny");
}

}  // namespace
}  // namespace forge
