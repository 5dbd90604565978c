// The schema table itself: every key is unique and reaches its own field, groups are
// contiguous (to_yaml relies on it), and values parse, range-check and format as promised.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "cli/config_schema.h"
#include "config_test_support.h"

namespace forge {
namespace {

using config_test::expect_error;

const ConfigKey& key(const std::string& name) {
  const ConfigKey* found = find_config_key(name);
  EXPECT_NE(found, nullptr) << name;
  return *found;
}

TEST(ConfigSchema, KeysAreUniqueAndReachDistinctFields) {
  ExperimentConfig config;
  std::set<std::string> names;
  std::set<const void*> fields;
  for (const auto& entry : config_schema()) {
    EXPECT_TRUE(names.insert(entry.name).second) << entry.name;
    const void* address = std::visit([](auto* field) -> const void* { return field; }, entry.field(config));
    EXPECT_TRUE(fields.insert(address).second) << entry.name << " shares a field with another key";
    EXPECT_FALSE(entry.description.empty()) << entry.name;
  }
}

// to_yaml writes a group's keys under one map: once the table leaves a group, no later
// key may return to it (YAML would see the group twice).
TEST(ConfigSchema, SectionsAndGroupsAreContiguousAndInOrder) {
  std::vector<std::string> section_order;
  std::set<std::string> left_groups;
  std::vector<std::string> open_groups;
  for (const auto& entry : config_schema()) {
    std::vector<std::string> groups;
    for (auto dot = entry.name.find('.'); dot != std::string::npos; dot = entry.name.find('.', dot + 1)) {
      groups.push_back(entry.name.substr(0, dot));
    }
    for (const auto& group : open_groups) {
      if (std::find(groups.begin(), groups.end(), group) == groups.end()) left_groups.insert(group);
    }
    for (const auto& group : groups) EXPECT_FALSE(left_groups.count(group)) << group << " is split in the table";
    open_groups = groups;
    if (section_order.empty() || section_order.back() != groups.front()) section_order.push_back(groups.front());
  }
  EXPECT_EQ(section_order, config_sections());
}

TEST(ConfigSchema, HasTheHuggingFaceLikeModelKeys) {
  for (const char* name :
       {"model.name", "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads",
        "model.num_kv_heads", "model.head_dim", "model.ffn_hidden_size", "model.norm_eps", "model.rope_theta",
        "model.rope_scaling.enabled", "model.rope_scaling.factor", "model.rope_scaling.low_freq_factor",
        "model.rope_scaling.high_freq_factor", "model.rope_scaling.original_max_position", "model.max_seq_len",
        "model.sliding_window", "model.tie_word_embeddings", "model.init_std"}) {
    EXPECT_NE(find_config_key(name), nullptr) << name;
  }
  EXPECT_TRUE(is_config_group("model"));
  EXPECT_TRUE(is_config_group("model.rope_scaling"));
  EXPECT_FALSE(is_config_group("model.rope"));
  EXPECT_FALSE(is_config_group("model.name"));
}

TEST(ConfigSchema, TypesAreDeducedFromFields) {
  EXPECT_EQ(key("training.steps").type, ConfigValueType::Integer);
  EXPECT_EQ(key("training.seed").type, ConfigValueType::Integer);
  EXPECT_EQ(key("optimizer.lr").type, ConfigValueType::Float);
  EXPECT_EQ(key("model.tie_word_embeddings").type, ConfigValueType::Bool);
  EXPECT_EQ(key("data.path").type, ConfigValueType::String);
  EXPECT_EQ(key("lr_scheduler.decay_style").type, ConfigValueType::Enum);
}

TEST(ConfigSchema, SetsAndFormatsEveryType) {
  ExperimentConfig config;
  set_config_value(key("training.steps"), config, "1000", "test");
  set_config_value(key("training.seed"), config, "18446744073709551615", "test");
  set_config_value(key("optimizer.lr"), config, "1.5e-4", "test");
  set_config_value(key("model.tie_word_embeddings"), config, "True", "test");
  set_config_value(key("data.path"), config, "/data/my corpus: v2", "test");
  set_config_value(key("lr_scheduler.decay_style"), config, "linear", "test");
  EXPECT_EQ(config.training.steps, 1000);
  EXPECT_EQ(config.training.seed, 18446744073709551615ull);
  EXPECT_DOUBLE_EQ(config.optimizer.lr, 1.5e-4);
  EXPECT_TRUE(config.model.tie_word_embeddings);
  EXPECT_EQ(config.data.path, "/data/my corpus: v2");
  EXPECT_EQ(config.lr_scheduler.decay_style, "linear");
  EXPECT_EQ(format_config_value(key("training.steps"), config), "1000");
  EXPECT_EQ(format_config_value(key("optimizer.lr"), config), "0.00015");
  EXPECT_EQ(format_config_value(key("model.tie_word_embeddings"), config), "true");
  EXPECT_EQ(format_config_value(key("data.path"), config), "\"/data/my corpus: v2\"");
  EXPECT_EQ(format_config_value(key("lr_scheduler.decay_style"), config), "linear");
}

TEST(ConfigSchema, QuotesStringsThatYamlWouldReadDifferently) {
  ExperimentConfig config;
  const ConfigKey& path = key("data.path");
  for (const char* text : {"", "true", "no", "null", "123", "~", "{x}", "-dash", "a#b", "say \"hi\"\\"}) {
    set_config_value(path, config, text, "test");
    EXPECT_EQ(format_config_value(path, config).front(), '"') << text;
  }
  set_config_value(path, config, "runs/{model}-{time}", "test");
  EXPECT_EQ(format_config_value(path, config), "runs/{model}-{time}");
}

TEST(ConfigSchema, WrongTypeNamesKeyAndExpectation) {
  ExperimentConfig config;
  expect_error([&] { set_config_value(key("training.steps"), config, "ten", "exp.yaml:4"); },
               {"exp.yaml:4", "training.steps expects an integer", "got 'ten'"});
  expect_error([&] { set_config_value(key("training.steps"), config, "2.5", "x"); }, {"got '2.5'"});
  expect_error([&] { set_config_value(key("training.seed"), config, "-1", "x"); }, {"training.seed", "got '-1'"});
  expect_error([&] { set_config_value(key("optimizer.lr"), config, "fast", "x"); },
               {"optimizer.lr expects a number", "got 'fast'"});
  expect_error([&] { set_config_value(key("optimizer.lr"), config, "nan", "x"); }, {"optimizer.lr"});
  expect_error([&] { set_config_value(key("model.tie_word_embeddings"), config, "maybe", "x"); },
               {"model.tie_word_embeddings expects true or false", "got 'maybe'"});
}

TEST(ConfigSchema, OutOfRangeNamesKeyAndRange) {
  ExperimentConfig config;
  expect_error([&] { set_config_value(key("training.steps"), config, "0", "command line"); },
               {"command line", "training.steps expects an integer >= 1", "got '0'"});
  expect_error([&] { set_config_value(key("training.local_batch_size"), config, "-2", "x"); },
               {"training.local_batch_size expects an integer >= 1"});
  expect_error([&] { set_config_value(key("optimizer.beta2"), config, "1", "x"); },
               {"optimizer.beta2 expects a number in [0, 1)", "got '1'"});
  expect_error([&] { set_config_value(key("model.norm_eps"), config, "0", "x"); },
               {"model.norm_eps expects a number > 0"});
}

TEST(ConfigSchema, EnumSuggestsTheNearestChoice) {
  ExperimentConfig config;
  expect_error([&] { set_config_value(key("data.source"), config, "mok", "x"); },
               {"data.source expects one of synthetic, mock, indexed", "got 'mok'", "did you mean 'mock'?"});
}

}  // namespace
}  // namespace forge
