// forge: the command line. Subcommands parse their own arguments into an experiment
// config (file + --section.key overrides) and hand it to the layer that does the work.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"

int main(int argc, char** argv) {
  CLI::App app{"forge: pre-train and fine-tune Llama-family models, and measure how fast a GPU system does it",
               "forge"};
  app.set_version_flag("--version", std::string("forge ") + FORGE_VERSION);
  app.require_subcommand(1);
  app.footer(
      "Overrides: any config key as --section.key VALUE or --section.key=VALUE, e.g. --training.local_batch_size 6.\n"
      "Run 'forge keys' for every key with its default and meaning.");

  std::vector<std::string> args;
  auto* train = app.add_subcommand("train", "Train a model: forge train [EXPERIMENT.yaml] [--section.key VALUE ...]");
  auto* info = app.add_subcommand("info", "Parameters, FLOPs per token and memory of a model: forge info MODEL|EXPERIMENT.yaml [overrides]");
  auto* keys = app.add_subcommand("keys", "List every config key with its type, default and description");
  std::string hf_dir;
  auto* hf_info = app.add_subcommand("hf-info", "Architecture of a Hugging Face model directory and the --model.* "
                                                 "overrides that train from it: forge hf-info DIR");
  hf_info->add_option("DIR", hf_dir, "Hugging Face model directory (config.json + safetensors)")->required();
  for (auto* sub : {train, info}) sub->prefix_command();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (train->parsed()) return forge::run_train(train->remaining());
    if (info->parsed()) return forge::run_info(info->remaining());
    if (keys->parsed()) return forge::run_keys();
    if (hf_info->parsed()) return forge::run_hf_info(hf_dir);
  } catch (const forge::Error& e) {
    forge::log_error("{}", e.what());
    return 1;
  } catch (const std::exception& e) {
    forge::log_error("internal error: {}", e.what());
    return 2;
  }
  return 0;
}
