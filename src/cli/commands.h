// The subcommands behind forge's CLI. Each takes the arguments after its name and returns
// the process exit code; user errors are thrown as forge::Error and printed by main.
#pragma once

#include <string>
#include <vector>

#include "data/dataset_prep.h"
#include "train/token_sampler.h"

namespace forge {

int run_train(const std::vector<std::string>& args);
int run_bench_command(const std::vector<std::string>& args);
int run_info(const std::vector<std::string>& args);
int run_keys();
int run_hf_info(const std::vector<std::string>& args);
// `chat_template` is --chat-template's value (empty when not given; --format sft only).
int run_prep(PrepOptions options, const std::string& tokenizer_path, const std::string& chat_template);
// Exit code 1 when any check failed; json_path empty: no JSON report.
int run_preflight(const std::string& json_path);
// forge eval [EXPERIMENT.yaml] --model PATH [--split S] [--batches N] [--json FILE] [overrides]
int run_eval(const std::vector<std::string>& args);

struct GenerateOptions {
  std::string model, adapter, tokenizer, prompt, prompt_file, device = "cpu", json;
  int64_t max_new_tokens = 128;
  SamplingOptions sampling;
  bool no_bos = false, ignore_eos = false;
};
int run_generate(const GenerateOptions& options);
int run_report(const std::vector<std::string>& run_dirs, const std::string& output);
// forge mlperf BENCHMARK [--runs N] [--seeds S,...] [--output DIR] [--org NAME] [--platform NAME]
// [--section.key VALUE ...] (mlperf_run_command.cpp): 0 when every run reached the target.
int run_mlperf_benchmark(const std::string& benchmark, const std::vector<std::string>& args);
// forge mlperf score DIR [--benchmark NAME] [--html FILE]: exit code 1 when the RCP check
// fails; `html` empty: no report.
int run_mlperf_score(const std::string& dir, const std::string& benchmark, const std::string& html);

}  // namespace forge
