// The subcommands behind forge's CLI. Each takes the arguments after its name and returns
// the process exit code; user errors are thrown as forge::Error and printed by main.
#pragma once

#include <string>
#include <vector>

#include "data/dataset_prep.h"

namespace forge {

int run_train(const std::vector<std::string>& args);
int run_bench_command(const std::vector<std::string>& args);
int run_info(const std::vector<std::string>& args);
int run_keys();
int run_hf_info(const std::vector<std::string>& args);
int run_prep(const PrepOptions& options, const std::string& tokenizer_path);
// Exit code 1 when any check failed; json_path empty: no JSON report.
int run_preflight(const std::string& json_path);
int run_report(const std::vector<std::string>& run_dirs, const std::string& output);

}  // namespace forge
