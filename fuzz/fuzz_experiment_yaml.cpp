// The experiment YAML file and --section.key overrides (cli/config.h): load_experiment
// with its model file lookup, validation and to_yaml of what it accepted. The input is
// the experiment file, then optionally a NUL byte and the command-line arguments, one per
// line ("--training.seq_len=64" or "--training.seq_len" and "64").
// Model files come from $FORGE_CONFIG_DIR/models (scripts/fuzz sets it to configs/).
#include <string>
#include <vector>

#include "cli/config.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto [yaml, arguments] = forge::fuzz::split_at_nul(forge::fuzz::as_view(data, size));
  std::vector<std::string> args;
  while (!arguments.empty()) {
    size_t end = arguments.find('\n');
    args.emplace_back(arguments.substr(0, end));
    arguments = end == std::string_view::npos ? std::string_view{} : arguments.substr(end + 1);
  }
  const std::string path = forge::fuzz::write_temp_file("experiment.yaml", yaml);
  forge::fuzz::expect_only_forge_errors([&] {
    forge::ConfigOverrides overrides = forge::parse_overrides(args);
    forge::ExperimentConfig config = forge::load_experiment(path, overrides);
    (void)forge::to_yaml(config);
  });
  return 0;
}
