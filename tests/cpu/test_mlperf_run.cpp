// forge mlperf's run plan (train/mlperf_benchmark.h: the reference settings at each global
// batch, the overrides the rules allow) and its MLLOG timeline (train/mlperf_logger.h:
// NOTE [MLPerf run timeline]) driven by hand with a fake clock.
#include <gtest/gtest.h>

#include <map>
#include <sstream>

#include "expect_error.h"
#include "file_testing.h"
#include "test_data_temp_dir.h"
#include "train/mlperf_benchmark.h"
#include "train/mlperf_logger.h"

namespace forge {
namespace {

using mllog::Json;
using mlperf::KeyRole;

std::map<std::string, std::string> last_values(const mlperf::KeyValues& overrides) {
  std::map<std::string, std::string> m;
  for (const auto& [key, value] : overrides) m[key] = value;
  return m;
}

TEST(MlperfPlan, Llama31ReferenceAndRcpHyperparameters) {
  const auto& b = mlperf::benchmark("llama31_8b");
  auto v = last_values(mlperf::plan_run(b, {}).overrides);
  EXPECT_EQ(v["model.name"], "llama3.1-8b");
  EXPECT_EQ(v["training.seq_len"], "8192");
  EXPECT_EQ(v["training.global_batch_size"], "32");
  EXPECT_EQ(v["optimizer.lr"], "0.0008");
  EXPECT_EQ(v["optimizer.eps"], "1e-05");
  EXPECT_EQ(v["lr_scheduler.warmup_steps"], "128");        // 4,096 samples
  EXPECT_EQ(v["lr_scheduler.decay_steps"], "1199872");     // 1.2 M - warm-up
  EXPECT_EQ(v["lr_scheduler.min_lr"], "8e-05");            // 0.1 × base
  EXPECT_EQ(v["eval.interval"], "384");                    // 12,288 / 32
  EXPECT_EQ(v["eval.steps"], "1024");                      // micro-batch 1

  // Another RCP batch brings its own LR and warm-up; the interval rounds up.
  auto plan = mlperf::plan_run(b, {{"training.global_batch_size", "96"}, {"training.local_batch_size", "4"}});
  v = last_values(plan.overrides);
  EXPECT_EQ(v["optimizer.lr"], "0.001");
  EXPECT_EQ(v["lr_scheduler.warmup_steps"], "171");  // CEIL(16,348 / 96)
  EXPECT_EQ(v["eval.interval"], "128");
  EXPECT_EQ(v["eval.steps"], "256");
  ASSERT_EQ(plan.hyperparameters.size(), 1u);
  EXPECT_EQ(plan.hyperparameters[0], "training.global_batch_size 96");

  // A batch without an RCP needs both; the user's warm-up moves the decay.
  expect_error([&] { mlperf::plan_run(b, {{"training.global_batch_size", "48"}}); },
               {"no llama31_8b RCP was measured at that batch", "16, 32, 64, 96, 128", "--lr_scheduler.warmup_steps"});
  v = last_values(mlperf::plan_run(b, {{"training.global_batch_size", "48"},
                                       {"optimizer.lr", "9e-4"},
                                       {"lr_scheduler.warmup_steps", "100"}})
                      .overrides);
  EXPECT_EQ(v["lr_scheduler.decay_steps"], "1199900");
  EXPECT_EQ(v["lr_scheduler.min_lr"], "9e-05");
  EXPECT_EQ(v["eval.interval"], "256");  // CEIL(12,288 / 48)
}

TEST(MlperfPlan, LoraReferenceAndSchedule) {
  const auto& b = mlperf::benchmark("llama2_70b_lora");
  auto v = last_values(mlperf::plan_run(b, {}).overrides);
  EXPECT_EQ(v["lora.rank"], "16");
  EXPECT_EQ(v["lora.alpha"], "32");
  EXPECT_EQ(v["lora.dropout"], "0.1");
  EXPECT_EQ(v["lora.target_modules"], "qkv_proj,o_proj");  // the reference's, on its fused-qkv model
  EXPECT_EQ(v["training.max_norm"], "0.3");
  EXPECT_EQ(v["optimizer.weight_decay"], "0.0001");
  EXPECT_EQ(v["optimizer.beta2"], "0.999");
  EXPECT_EQ(v["training.steps"], "1024");
  EXPECT_EQ(v["lr_scheduler.warmup_steps"], "0");
  EXPECT_EQ(v["eval.interval"], "48");
  EXPECT_EQ(v["eval.steps"], "173");
  EXPECT_EQ(v["eval.average"], "micro_batches");
  EXPECT_EQ(mlperf::skipped_evaluations(b, 8), 3);
  EXPECT_EQ(mlperf::skipped_evaluations(b, 16), 4);
  EXPECT_EQ(mlperf::skipped_evaluations(b, 128), 18);
  EXPECT_EQ(mlperf::eval_interval_steps(b, 128), 3);  // CEIL(384 / 128)
  EXPECT_EQ(last_values(mlperf::plan_run(b, {{"training.global_batch_size", "128"}}).overrides)["optimizer.lr"],
            "0.001");
  expect_error([&] { mlperf::plan_run(b, {{"training.local_batch_size", "2"}}); },
               {"--training.local_batch_size 2", "must be 1"});
  expect_error([&] { mlperf::plan_run(b, {{"lora.rank", "8"}}); }, {"--lora.rank", "llama2_70b_lora fixes it"});
}

TEST(MlperfPlan, FluxReferenceAndRcpHyperparameters) {
  // NOTE [MLPerf Flux.1]: closed_flux1.yaml's fixed values, the reference's recipe, rcps_flux1.json.
  const auto& b = mlperf::benchmark("flux1");
  auto v = last_values(mlperf::plan_run(b, {{"training.local_batch_size", "16"}}).overrides);
  EXPECT_EQ(v["flux.model"], "flux1-schnell");
  EXPECT_EQ(v.count("model.name"), 0u);
  EXPECT_EQ(v["flux.resolution"], "256");
  EXPECT_EQ(v["flux.text_tokens"], "256");
  EXPECT_EQ(v["flux.timestep_sampling"], "uniform");
  EXPECT_EQ(v["flux.timestep_shift"], "none");
  EXPECT_EQ(v["flux.weight_init"], "torchtitan");
  EXPECT_EQ(v["flux.caption_dropout_prob"], "0.1");
  EXPECT_EQ(v["training.global_batch_size"], "512");
  EXPECT_EQ(v["optimizer.lr"], "0.0002");
  EXPECT_EQ(v["optimizer.beta2"], "0.95");
  EXPECT_EQ(v["optimizer.eps"], "1e-08");
  EXPECT_EQ(v["optimizer.weight_decay"], "0.1");
  EXPECT_EQ(v["training.max_norm"], "1.0");
  EXPECT_EQ(v["lr_scheduler.warmup_steps"], "1600");
  EXPECT_EQ(v["lr_scheduler.decay_style"], "constant");
  EXPECT_EQ(v["eval.interval"], "512");   // 262,144 / 512
  EXPECT_EQ(v["eval.steps"], "1856");     // 29,696 / 16
  EXPECT_EQ(v["training.steps"], "62500");  // 32 M images
  v = last_values(mlperf::plan_run(b, {{"training.global_batch_size", "4096"}}).overrides);
  EXPECT_EQ(v["optimizer.lr"], "0.0004");
  EXPECT_EQ(v["lr_scheduler.warmup_steps"], "100");
  EXPECT_EQ(v["eval.interval"], "64");
  EXPECT_EQ(mlperf::skipped_evaluations(b, 512), 0);
  expect_error([&] { mlperf::plan_run(b, {{"training.global_batch_size", "256"}}); },
               {"no flux1 RCP was measured at that batch", "512, 1024, 2048, 4096"});
  expect_error([&] { mlperf::plan_run(b, {{"flux.timestep_sampling", "logit_normal"}}); },
               {"--flux.timestep_sampling", "flux1 fixes it", "flux.num_double_blocks"});
  expect_error([&] { mlperf::plan_run(b, {{"training.local_batch_size", "10"}}); },
               {"flux1 evaluates 29696", "must divide 29696"});
  EXPECT_EQ(mlperf::key_role(b, "flux.data_path"), KeyRole::System);
  EXPECT_EQ(mlperf::key_role(b, "flux.eval_data_path"), KeyRole::System);
  EXPECT_EQ(mlperf::key_role(b, "flux.num_single_blocks"), KeyRole::NotBenchmark);
  EXPECT_EQ(mlperf::key_role(b, "flux.resolution"), KeyRole::NotBenchmark);
  EXPECT_EQ(mlperf::key_role(b, "flux.weight_init"), KeyRole::Reference);
  EXPECT_EQ(mlperf::key_role(b, "optimizer.lr"), KeyRole::Hyperparameter);
  EXPECT_EQ(mlperf::key_role(b, "model.name"), KeyRole::Reference);
}

TEST(MlperfPlan, KeyRoles) {
  const auto& b8 = mlperf::benchmark("llama31_8b");
  const auto& lora = mlperf::benchmark("llama2_70b_lora");
  EXPECT_EQ(mlperf::key_role(b8, "optimizer.lr"), KeyRole::Hyperparameter);
  EXPECT_EQ(mlperf::key_role(b8, "optimizer.beta2"), KeyRole::Reference);
  EXPECT_EQ(mlperf::key_role(b8, "training.steps"), KeyRole::System);
  EXPECT_EQ(mlperf::key_role(lora, "training.steps"), KeyRole::Hyperparameter);
  EXPECT_EQ(mlperf::key_role(b8, "precision.fp8"), KeyRole::System);
  EXPECT_EQ(mlperf::key_role(b8, "data.validation_path"), KeyRole::System);
  EXPECT_EQ(mlperf::key_role(lora, "data.validation_path"), KeyRole::Reference);
  EXPECT_EQ(mlperf::key_role(lora, "checkpoint.initial_load_path"), KeyRole::System);
  EXPECT_EQ(mlperf::key_role(b8, "model.num_layers"), KeyRole::NotBenchmark);
  EXPECT_EQ(mlperf::key_role(b8, "lr_scheduler.decay_style"), KeyRole::Reference);
  EXPECT_EQ(mlperf::key_role(b8, "no.such_key"), KeyRole::Reference);
  expect_error([&] { mlperf::plan_run(b8, {{"optimizer.lr", "fast"}}); },
               {"--optimizer.lr 'fast'", "positive number"});
  expect_error([] { mlperf::benchmark("resnet"); }, {"'resnet'", "llama31_8b, llama2_70b_lora and flux1"});
}

std::vector<Json> mllog_lines(const std::string& path) {
  std::istringstream in(testing::read_file(path));
  std::vector<Json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(Json::parse(line.substr(9)));
  return lines;
}

ExperimentConfig lora_config() {
  ExperimentConfig c;
  c.training.global_batch_size = 8;
  c.training.local_batch_size = 1;
  c.training.gradient_accumulation_steps = 8;
  c.training.seq_len = 8191;
  c.training.steps = 1024;
  c.training.max_norm = 0.3;
  c.eval.interval = 48;
  c.eval.steps = 173;
  c.lora.rank = 16;
  c.lora.alpha = 32;
  return c;
}

TEST(MlperfLogger, TimelineScheduleAndTarget) {
  TempDir dir;
  const std::string path = dir.file("result_0.txt");
  int64_t now = 5000;
  const auto& b = mlperf::benchmark("llama2_70b_lora");
  mlperf::MlperfLogger log(b, path, true, false, [&] { return now; });
  log.header(lora_config(), 1234, {.platform = "1xTEST"}, 3901);
  now = 9000;
  log.training_begins(0);
  StepMetrics m;
  m.step_time_s = 2.0;
  m.tokens_per_s = 100;
  m.model_tflops = 1.5;
  std::vector<int64_t> evaluated;
  bool stopped = false;
  for (int64_t step = 1; step <= 400 && !stopped; ++step) {
    log.step_done(m, step * 8);
    if (!log.evaluation_due(step, step * 8, false)) continue;
    evaluated.push_back(step);
    log.evaluation_begins(step * 8);
    EvalMetrics e;
    e.loss = evaluated.size() == 3 ? 0.92 : 1.2;
    stopped = log.evaluation_done(e, step * 8);
  }
  EXPECT_TRUE(stopped);
  EXPECT_TRUE(log.succeeded());
  EXPECT_EQ(evaluated, (std::vector<int64_t>{192, 240, 288}));  // 3 skipped, then every 48 steps
  now = 69000;
  log.training_ends(288 * 8, true);
  log.training_ends(288 * 8, true);  // once only

  const auto lines = mllog_lines(path);
  std::vector<std::string> keys;
  for (const auto& l : lines) keys.push_back(l["key"]);
  EXPECT_EQ(keys.front(), "cache_clear");
  EXPECT_EQ(keys[1], "init_start");
  const auto at = [&](const std::string& key) {
    return static_cast<size_t>(std::find(keys.begin(), keys.end(), key) - keys.begin());
  };
  EXPECT_LT(at("lora_rank"), at("init_stop"));
  EXPECT_EQ(at("init_stop") + 1, at("run_start"));
  EXPECT_EQ(lines[at("run_start")]["time_ms"], 9000);
  EXPECT_EQ(lines[at("train_samples")]["value"], 3901);
  EXPECT_EQ(lines[at("eval_samples")]["value"], 173);
  EXPECT_EQ(lines[at("max_sequence_length")]["value"], 8192);
  EXPECT_EQ(lines[at("submission_platform")]["value"], "1xTEST");
  const Json& stats = lines[at("tracked_stats")];
  EXPECT_DOUBLE_EQ(stats["value"]["throughput"].get<double>(), 4.0);  // 8 samples per 2 s step
  EXPECT_DOUBLE_EQ(stats["value"]["tokens_per_s_per_gpu"].get<double>(), 100.0);
  EXPECT_EQ(stats["metadata"]["step"], 1536);
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "eval_accuracy"), 3);
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "block_start"), 3);
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "block_stop"), 3);
  EXPECT_EQ(keys.back(), "run_stop");
  EXPECT_EQ(lines.back()["metadata"]["status"], "success");
  EXPECT_EQ(lines.back()["metadata"]["samples_count"], 2304);
  EXPECT_EQ(lines.back()["time_ms"], 69000);
}

TEST(MlperfLogger, AbortClosesTheBlockAndOnlyRankZeroWrites) {
  TempDir dir;
  const auto& b = mlperf::benchmark("llama31_8b");
  ExperimentConfig c;
  c.training.global_batch_size = 32;
  c.eval.interval = 384;
  {
    mlperf::MlperfLogger log(b, dir.file("result_0.txt"), true, false);
    log.header(c, 7, {.platform = "x"}, 0);
    log.training_begins(0);
    log.step_done(StepMetrics{}, 32);
    log.abort();
  }
  const auto lines = mllog_lines(dir.file("result_0.txt"));
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(lines[lines.size() - 3]["key"], "block_stop");
  EXPECT_EQ(lines[lines.size() - 2]["key"], "run_stop");
  EXPECT_EQ(lines[lines.size() - 2]["metadata"]["status"], "aborted");
  EXPECT_EQ(lines.back()["key"], "train_samples");
  EXPECT_EQ(lines.back()["value"], 32);

  mlperf::MlperfLogger silent(b, dir.file("result_1.txt"), false, false);
  silent.header(c, 7, {}, 0);
  silent.training_begins(0);
  silent.abort();
  EXPECT_FALSE(std::filesystem::exists(dir.file("result_1.txt")));
}

}  // namespace
}  // namespace forge
