// forge: the command line. Subcommands parse their own arguments into an experiment
// config (file + --section.key overrides) and hand it to the layer that does the work.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/image_prep_command.h"
#include "cli/sample_command.h"
#include "core/error.h"
#include "core/filesystem_error.h"
#include "core/log.h"
#include "distributed/launcher.h"

int main(int argc, char** argv) {
  CLI::App app{"forge: pre-train and fine-tune Llama-family models, and measure how fast a GPU system does it",
               "forge"};
  app.set_version_flag("--version", std::string("forge ") + FORGE_VERSION);
  app.require_subcommand(1);
  const std::string overrides_footer =
      "Overrides: any config key as --section.key VALUE or --section.key=VALUE, e.g. --training.local_batch_size 6.\n"
      "Run 'forge keys' for every key with its default and meaning.";

  std::vector<std::string> args;
  auto* train = app.add_subcommand("train", "Train a model: forge train [EXPERIMENT.yaml] [--section.key VALUE ...]");
  auto* info = app.add_subcommand("info", "Parameters, FLOPs per token and memory of a model, and for a Hugging Face "
                                          "directory the config it implies: forge info MODEL|EXPERIMENT.yaml|HF_DIR "
                                          "[overrides]");
  auto* bench = app.add_subcommand(
      "bench",
      "Benchmark an experiment (or a sweep: --section.key V1,V2) for warm-up + measured steps on mock data: "
      "forge bench [EXPERIMENT.yaml] [--warmup N] [--steps N] [--find-max-batch] [--output-dir DIR] "
      "[--perf-csv FILE] [--section.key VALUE ...]");
  auto* keys = app.add_subcommand("keys", "List every config key with its type, default and description");
  auto* eval = app.add_subcommand(
      "eval", "Loss and perplexity of a model on an experiment's data: forge eval [EXPERIMENT.yaml] --model "
              "CHECKPOINT|RUN_DIR|HF_DIR [--adapter DIR] [--split validation|train|test] [--batches N] [--json FILE] "
              "[--section.key VALUE ...]");

  forge::GenerateOptions generate_options;
  auto* generate = app.add_subcommand(
      "generate", "Generate text from a model and a prompt with a KV cache, greedy or sampled, streamed to stdout");
  generate->footer("Example: forge generate --model /models/Llama-3.2-1B --prompt 'The capital of France is' "
                   "--max-new-tokens 32");
  generate->add_option("--model", generate_options.model,
                       "forge checkpoint (step-N), folder of checkpoints, run directory, or Hugging Face folder")
      ->required();
  generate->add_option("--adapter", generate_options.adapter,
                       "a PEFT LoRA adapter directory merged into the model (a LoRA run directory as --model brings "
                       "its own)");
  generate->add_option("--tokenizer", generate_options.tokenizer,
                       "tokenizer.json, tokenizer.model or a folder holding one (default: the Hugging Face folder)");
  generate->add_option("--prompt", generate_options.prompt, "prompt text (after --prompt-file's, when both)");
  generate->add_option("--prompt-file", generate_options.prompt_file, "file whose text starts the prompt");
  generate->add_option("--max-new-tokens", generate_options.max_new_tokens, "tokens to generate at most")
      ->capture_default_str();
  generate->add_option("--temperature", generate_options.sampling.temperature, "0: greedy; > 0: sample")
      ->capture_default_str();
  generate->add_option("--top-k", generate_options.sampling.top_k, "sample among the k most likely (0: all)")
      ->capture_default_str();
  generate->add_option("--top-p", generate_options.sampling.top_p, "nucleus sampling: the most likely tokens "
                                                                  "whose probability reaches p")
      ->capture_default_str();
  generate->add_option("--seed", generate_options.sampling.seed, "seed of the sampling")->capture_default_str();
  generate->add_option("--device", generate_options.device, "cpu or cuda")->capture_default_str();
  generate->add_flag("--no-bos", generate_options.no_bos, "do not put the tokenizer's BOS before the prompt");
  generate->add_flag("--ignore-eos", generate_options.ignore_eos, "generate max-new-tokens whatever comes");
  generate->add_option("--json", generate_options.json,
                       "also write the prompt's and the new tokens' ids, the text and timings to FILE")
      ->type_name("FILE");
  auto* hf_info = app.add_subcommand(
      "hf-info", "The experiment YAML that trains from a Hugging Face model directory (config.json + safetensors), "
                 "with its architecture as comments: forge hf-info DIR [--section.key VALUE ...] > exp.yaml");
  // The commands that take --section.key overrides say so; the others take none.
  for (auto* sub : {train, info, bench, hf_info, eval}) sub->prefix_command()->footer(overrides_footer);
  eval->footer("The architecture comes from the model; the data, training.local_batch_size, training.seq_len and "
               "training.device from the experiment and overrides. --batches defaults to eval.steps.\n" +
               overrides_footer);

  forge::PrepOptions prep_options;
  std::string prep_tokenizer, prep_format = "text", prep_chat_template, prep_train_on = "all",
                              prep_overlong = "truncate";
  bool no_append_eod = false;
  auto* prep = app.add_subcommand(
      "prep", "Tokenize JSON Lines or text files (optionally .gz/.zst) into a Megatron indexed dataset (.bin/.idx), "
              "or with --images encode images with captions into a FLUX latent cache");
  // Text mode requires --input, --tokenizer and --output-prefix (checked below: --images needs none of them).
  auto* prep_input = prep->add_option("--input", prep_options.inputs,
                                      "input file, repeatable: .jsonl/.json/.ndjson or .txt, optionally .gz or .zst");
  auto* prep_tokenizer_option =
      prep->add_option("--tokenizer", prep_tokenizer, "tokenizer.json, tokenizer.model, or a directory holding one");
  auto* prep_output_prefix =
      prep->add_option("--output-prefix", prep_options.output_prefix, "writes PREFIX.bin and PREFIX.idx");
  prep->add_option("--json-key", prep_options.json_key, "JSON Lines: key of the text")->capture_default_str();
  auto* append_eod =
      prep->add_flag("--append-eod", prep_options.append_eod, "append the tokenizer's EOS to every document (default)");
  prep->add_flag("--no-append-eod", no_append_eod, "do not append EOS")->excludes(append_eod);
  prep->add_flag("--text-per-line", prep_options.text_per_line,
                 ".txt inputs: every non-empty line is a document (default: the whole file is one)");
  prep->add_flag("--skip-bad-lines", prep_options.skip_bad_lines,
                 "JSON Lines: skip and count malformed lines instead of failing");
  prep->add_option("--workers", prep_options.workers, "tokenizing threads (default: FORGE_NUM_THREADS or all cores)")
      ->check(CLI::Range(1, 4096));
  prep->add_flag("--prepend-bos", prep_options.prepend_bos,
                 "put the tokenizer's BOS id in front of every document that does not start with it");
  prep->add_option("--format", prep_format,
                   "text: documents under --json-key or .txt files; sft: instruction examples (prompt/completion, "
                   "Alpaca, chat messages), writing PREFIX.bin/.idx and the loss mask PREFIX.mask.bin/.idx")
      ->check(CLI::IsMember({"text", "sft"}))->capture_default_str();
  prep->add_option("--chat-template", prep_chat_template,
                   "sft: llama3|llama2|mistral|auto|none (default: auto when tokenizer_config.json beside the "
                   "tokenizer has a chat_template, else none)")
      ->check(CLI::IsMember({"llama3", "llama2", "mistral", "auto", "none"}));
  prep->add_option("--train-on", prep_train_on, "sft chat: which assistant turns are trained on: all or last")
      ->check(CLI::IsMember({"all", "last"}))->capture_default_str();
  prep->add_option("--seq-len", prep_options.seq_len,
                   "sft: training sequence length; an example fits with at most seq-len + 1 tokens (default 0: no limit)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  prep->add_option("--overlong", prep_overlong, "sft: truncate or drop examples longer than --seq-len + 1 tokens")
      ->check(CLI::IsMember({"truncate", "drop"}))->capture_default_str();
  forge::ImagePrepOptions image_prep_options;
  forge::add_image_prep_options(*prep, image_prep_options);
  prep->footer("Example: forge prep --input c4.00000.json.gz --tokenizer /models/llama3/tokenizer.json "
               "--output-prefix /data/c4_text_document\n"
               "FLUX: forge prep --images /data/photos --pipeline /models/FLUX.1-dev --output /data/photos-cache "
               "[--resolution 1024] [--buckets aspect] [--device cuda]");

  forge::LaunchOptions launch_options;
  auto* launch = app.add_subcommand(
      "launch", "Start this node's ranks of a multi-GPU job, as torchrun does: forge launch --nproc-per-node N "
                "[--nnodes M --node-rank R --master-addr A --master-port P] -- COMMAND ...");
  launch->add_option("--nproc-per-node", launch_options.nproc_per_node, "ranks (GPUs) on this node")
      ->required()->check(CLI::Range(1, 1024));
  launch->add_option("--nnodes", launch_options.nnodes, "nodes in the job")->capture_default_str();
  launch->add_option("--node-rank", launch_options.node_rank, "this node's index, 0 .. nnodes-1")
      ->capture_default_str();
  launch->add_option("--master-addr", launch_options.master_addr, "host of node 0 (default 127.0.0.1 on one node)");
  launch->add_option("--master-port", launch_options.master_port,
                     "port rank 0 listens on (default: a free port on one node, 29500 on several)");
  launch->add_option("--grace-period", launch_options.grace_period_s,
                     "seconds from SIGTERM to SIGKILL when ranks are stopped")->capture_default_str();
  launch->add_option("--max-restarts", launch_options.max_restarts,
                     "after a failure, start this node's ranks again up to N times (they resume from the newest "
                     "checkpoint)")->capture_default_str()->check(CLI::Range(0, 1000000));
  launch->add_option("COMMAND", launch_options.command,
                     "after --: a forge subcommand and its arguments (train ...), or a program to run")->required();
  forge::SampleOptions sample_options;
  auto* sample = forge::add_sample_command(app, sample_options);

  std::string preflight_json;
  auto* preflight = app.add_subcommand("preflight", "Validate the GPUs before training: inventory, GEMM, memory, "
                                                    "PCIe and NCCL bandwidth against healthy references");
  preflight->add_option("--json", preflight_json, "also write the report as JSON to FILE")->type_name("FILE");
  preflight->footer("Exits with 1 when any check fails. Example: forge preflight --json preflight.json");

  std::vector<std::string> report_dirs;
  std::string report_output = "report.html";
  auto* report = app.add_subcommand("report", "One self-contained HTML page comparing runs: forge report RUN_DIR "
                                              "[RUN_DIR ...] [--output FILE.html]");
  report->add_option("RUN_DIR", report_dirs, "run directory (metrics.jsonl; bench.json when present)")->required();
  report->add_option("--output,-o", report_output, "HTML file to write")->capture_default_str();

  auto* mlperf = app.add_subcommand("mlperf", "MLPerf Training: run a benchmark to its quality target with MLLOG "
                                              "result files, or score a set of them");
  mlperf->require_subcommand(1);
  std::vector<CLI::App*> mlperf_runs;
  for (const char* name : {"llama31_8b", "llama2_70b_lora", "flux1"}) {
    auto* run = mlperf->add_subcommand(
        name, fmt::format("Run MLPerf Training's {} as its reference does: forge mlperf {} [--runs N] "
                          "[--seeds S1,S2,...] [--output DIR] [--org NAME] [--platform NAME] [--section.key VALUE ...]",
                          name, name));
    run->prefix_command();
    const std::string which = name;
    run->footer(which == "flux1"
                    ? "Needs --flux.data_path DIR (the CC12M latent cache) and --flux.eval_data_path DIR (the COCO "
                      "validation cache), both from forge prep --images. Writes DIR/result_K.txt and DIR/run_K per "
                      "run (DIR default mlperf-results). Overrides: the hyperparameters the rules let a submitter "
                      "choose and the system settings; see the README's \"MLPerf\" section."
                : which == "llama31_8b"
                    ? "Needs --data.path PREFIX (c4-train.en_6_text_document) and --data.validation_path PREFIX "
                      "(c4-validation-91205-samples.en_text_document). Writes DIR/result_K.txt and DIR/run_K per "
                      "run (DIR default mlperf-results). Overrides: the hyperparameters the rules let a submitter "
                      "choose and the system settings; see the README's \"MLPerf\" section."
                    : "Needs --data.path DIR (GovReport train.npy and validation.npy) and "
                      "--checkpoint.initial_load_path DIR (Hugging Face Llama 2 70B). Writes DIR/result_K.txt and "
                      "DIR/run_K per run (DIR default mlperf-results). Overrides: the hyperparameters the rules let "
                      "a submitter choose and the system settings; see the README's \"MLPerf\" section.");
    mlperf_runs.push_back(run);
  }
  std::string mlperf_score_dir, mlperf_score_benchmark, mlperf_score_html;
  auto* mlperf_score = mlperf->add_subcommand(
      "score", "Time-to-train of DIR/result_*.txt: olympic mean, RCP normalization and score, as the MLPerf "
               "result summarizer and RCP checker compute them");
  mlperf_score->add_option("DIR", mlperf_score_dir, "directory of result_*.txt files")->required();
  mlperf_score->add_option("--benchmark", mlperf_score_benchmark,
                           "llama31_8b, llama2_70b_lora or flux1 (default: the logs' submission_benchmark)")
      ->check(CLI::IsMember({"llama31_8b", "llama2_70b_lora", "flux1"}));
  mlperf_score->add_option("--html", mlperf_score_html,
                           "also write a self-contained HTML report (summary, runs with throughput, eval curves) "
                           "to FILE")
      ->type_name("FILE");
  mlperf_score->footer("Exits with 1 when a file is malformed, the set cannot be scored, or the RCP check fails.");

  // Set last: subcommands created after it would inherit it.
  app.footer("train, info, bench, hf-info, eval and mlperf BENCHMARK take overrides: any config key as "
             "--section.key VALUE or "
             "--section.key=VALUE, e.g. --training.local_batch_size 6.\nRun 'forge keys' for every key with its "
             "default and meaning.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (train->parsed()) return forge::run_train(train->remaining());
    if (info->parsed()) return forge::run_info(info->remaining());
    if (bench->parsed()) return forge::run_bench_command(bench->remaining());
    if (eval->parsed()) return forge::run_eval(eval->remaining());
    if (generate->parsed()) return forge::run_generate(generate_options);
    if (sample->parsed()) return forge::run_sample(sample_options);
    if (keys->parsed()) return forge::run_keys();
    if (hf_info->parsed()) return forge::run_hf_info(hf_info->remaining());
    if (launch->parsed()) {
      std::vector<std::string> subcommands;
      for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
        subcommands.push_back(sub->get_name());
      return forge::run_launch(launch_options, subcommands);
    }
    if (preflight->parsed()) return forge::run_preflight(preflight_json);
    if (report->parsed()) return forge::run_report(report_dirs, report_output);
    if (mlperf_score->parsed()) return forge::run_mlperf_score(mlperf_score_dir, mlperf_score_benchmark, mlperf_score_html);
    for (auto* run : mlperf_runs)
      if (run->parsed()) return forge::run_mlperf_benchmark(run->get_name(), run->remaining());
    if (prep->parsed()) {
      if (prep->count("--images") > 0) {
        for (const CLI::Option* option : prep->get_options())
          if (option->count() > 0 && option->get_name() != "--images" && !forge::is_image_prep_flag(option->get_name()))
            throw forge::Error(
                fmt::format("forge prep --images: {} applies to text datasets, not images", option->get_name()));
        return forge::run_image_prep(image_prep_options);
      }
      if (const std::string flag = forge::image_prep_flag_given(*prep); !flag.empty())
        throw forge::Error(fmt::format("forge prep: {} applies to --images DATASET (FLUX latent caches)", flag));
      for (const auto* required : {prep_input, prep_tokenizer_option, prep_output_prefix})
        if (required->count() == 0)
          throw forge::Error(fmt::format("forge prep: {} is required (or --images DATASET for a FLUX latent cache)",
                                         required->get_name()));
      if (no_append_eod) prep_options.append_eod = false;
      prep_options.format = prep_format == "sft" ? forge::PrepFormat::Sft : forge::PrepFormat::Text;
      prep_options.sft.train_on =
          prep_train_on == "last" ? forge::TrainOn::LastAssistantTurn : forge::TrainOn::AllAssistantTurns;
      prep_options.overlong = prep_overlong == "drop" ? forge::Overlong::Drop : forge::Overlong::Truncate;
      return forge::run_prep(prep_options, prep_tokenizer, prep_chat_template);
    }
  } catch (const forge::Error& e) {
    forge::log_error("{}", e.what());
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    // A path forge was given, or built from what it was given, that the system refused
    // (a name too long, no permission, a loop of links): the path and the system's reason.
    forge::log_error("{}", forge::describe_filesystem_error(e));
    return 1;
  } catch (const std::exception& e) {
    forge::log_error("internal error: {}", e.what());
    return 2;
  }
  return 0;
}
