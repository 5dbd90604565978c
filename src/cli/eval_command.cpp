// forge eval: the loss and perplexity of a model (a forge checkpoint, a run directory or a
// Hugging Face folder: NOTE [Model sources]) on an experiment's data.
//
//   forge eval [EXPERIMENT.yaml] --model PATH [--adapter DIR] [--split validation|train|test]
//              [--batches N] [--json FILE] [--section.key VALUE ...]
//
// --adapter merges a PEFT adapter into the model; a LoRA run directory as --model brings
// its base and adapter itself (cli/inference_model.h).
//
// With no experiment file and a run directory as the model, the run's config.yaml is the
// experiment (its data, batch shape and device). The architecture is the model's: its keys are given to the experiment as model.*
// overrides ahead of the user's, so the experiment file's model section is not used and an
// explicit --model.* override that contradicts the model is an error. The data, batch
// shape (training.local_batch_size, training.seq_len) and device (training.device) are the
// experiment's, as forge train would read them.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <sstream>

#include "ckpt/hf_import.h"
#include "cli/inference_model.h"
#include "cli/commands.h"
#include "cli/config.h"
#include "core/durable_file.h"
#include "core/log.h"
#include "train/evaluation.h"

namespace forge {
namespace {

struct EvalArgs {
  std::string experiment, model, adapter, split = "validation", json;
  int64_t batches = -1;  // -1: eval.steps
  ConfigOverrides overrides;
};

int64_t parse_batches(const std::string& text) {
  int64_t value = 0;
  size_t used = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || value < 1) FORGE_FAIL("forge eval: --batches '{}': expected an integer >= 1", text);
  return value;
}

EvalArgs parse_eval_args(const std::vector<std::string>& args) {
  EvalArgs out;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    bool matched = false;
    for (const char* flag : {"--model", "--adapter", "--split", "--batches", "--json"}) {
      std::string value;
      if (arg == flag) {
        if (i + 1 == args.size()) FORGE_FAIL("forge eval: {} needs a value", flag);
        value = args[++i];
      } else if (arg.starts_with(std::string(flag) + "=")) {
        value = arg.substr(std::string(flag).size() + 1);
      } else {
        continue;
      }
      matched = true;
      if (std::string(flag) == "--model") out.model = value;
      if (std::string(flag) == "--adapter") out.adapter = value;
      if (std::string(flag) == "--split") out.split = value;
      if (std::string(flag) == "--batches") out.batches = parse_batches(value);
      if (std::string(flag) == "--json") out.json = value;
      break;
    }
    if (matched) continue;
    if (!arg.starts_with("--") && out.experiment.empty() && overrides.empty()) {
      out.experiment = arg;
    } else {
      overrides.push_back(arg);
    }
  }
  if (!overrides.empty() && !overrides.front().starts_with("--"))
    FORGE_FAIL("forge eval: unexpected argument '{}': give at most one experiment file, then --section.key VALUE "
               "overrides",
               overrides.front());
  out.overrides = parse_overrides(overrides);
  if (out.model.empty())
    FORGE_FAIL("forge eval: give the model to evaluate: --model CHECKPOINT_DIR|RUN_DIR|HF_DIR");
  return out;
}

Split parse_split(const std::string& name) {
  for (Split s : {Split::Train, Split::Validation, Split::Test})
    if (split_name(s) == name) return s;
  FORGE_FAIL("forge eval: --split '{}': expected train, validation or test", name);
}

// The model's architecture as model.* overrides.
ConfigOverrides model_overrides(const ModelConfig& model) {
  ConfigOverrides out;
  std::istringstream words(model_overrides_for(model));
  std::string key, value;
  while (words >> key >> value) out.emplace_back(key.substr(2), value);
  return out;
}

}  // namespace

int run_eval(const std::vector<std::string>& args) {
  EvalArgs a = parse_eval_args(args);
  const Split split = parse_split(a.split);
  std::error_code error;
  const std::string run_config = (std::filesystem::path(a.model) / "config.yaml").string();
  if (a.experiment.empty() && std::filesystem::is_regular_file(run_config, error)) {
    a.experiment = run_config;  // a run directory: evaluate on the data it trained with
    log_info("experiment: {} (the run's own; give an experiment file to use other data)", run_config);
  }
  LoadedModel loaded = load_inference_model(a.model, a.adapter);
  ConfigOverrides overrides = model_overrides(loaded.config);
  overrides.insert(overrides.end(), a.overrides.begin(), a.overrides.end());
  ExperimentConfig config = load_experiment(a.experiment, overrides);
  std::vector<std::string> differences = architecture_differences(config.model, loaded.config);
  for (std::string& d : differences)  // the model may be a forge checkpoint: no config.json
    if (d.ends_with(" in config.json")) d = d.substr(0, d.size() - 15) + " in the model";
  if (!differences.empty())
    FORGE_FAIL("forge eval: the overrides contradict the architecture of {} (\"here\" is the override; drop it): {}",
               loaded.description, fmt::join(differences, "; "));
  config.model.name = loaded.config.name;  // model.name would name a preset file, not the model
  const int64_t batches = a.batches > 0 ? a.batches : config.eval.steps;
  if (batches < 1) FORGE_FAIL("forge eval: eval.steps is {}: give --batches N (N >= 1)", config.eval.steps);
  log_info("evaluating {} ({} parameters) on {} data, {} split: {} batches of {} x {} tokens on {}",
           loaded.description, config.model.total_params(), config.data.source, a.split, batches,
           config.training.local_batch_size, config.training.seq_len, config.training.device);
  const EvalSummary s = evaluate_weights(config, *loaded.params, split, batches);
  fmt::print("loss {:.6f} nats/token, perplexity {:.4f} ({} target tokens in {} sequences; {:.2f} s)\n", s.loss,
             s.perplexity, s.tokens, s.sequences, s.seconds);
  if (!a.json.empty()) {
    const nlohmann::ordered_json report = {{"model", a.model},
                                           {"adapter", loaded.adapter_dir},
                                           {"model_name", config.model.name},
                                           {"source", loaded.description},
                                           {"data_source", config.data.source},
                                           {"split", a.split},
                                           {"batches", s.batches},
                                           {"micro_batch", config.training.local_batch_size},
                                           {"seq_len", config.training.seq_len},
                                           {"sequences", s.sequences},
                                           {"samples_in_split", s.samples_in_split},
                                           {"tokens", s.tokens},
                                           {"loss", s.loss},
                                           {"perplexity", s.perplexity},
                                           {"device", config.training.device},
                                           {"seconds", s.seconds}};
    write_file_atomic(a.json, report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", DurableOptions{});
    log_info("wrote {}", a.json);
  }
  return 0;
}

}  // namespace forge
