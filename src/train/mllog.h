// MLPerf Training's MLLOG lines, written as the reference `mlperf_logging.mllog` package
// (PyPI mlperf-logging 4.1.68, mlperf_logging/mllog/mllog.py) writes them, so that its
// compliance checker, RCP checker and result summarizer read forge's logs.
//
// NOTE [MLLOG line format]
// One event per line: `:::MLLOG ` then a JSON object whose keys come in this order, with
// Python json.dumps' separators (", " and ": "), ASCII-only strings and Python's float
// spelling (shortest round trip: 0.0008, 1e-05, 1.0; NaN as NaN):
//   {"namespace": "", "time_ms": 1732467890123, "event_type": "POINT_IN_TIME",
//    "key": "eval_accuracy", "value": 3.29, "metadata": {"file": "src/train/x.cpp",
//    "lineno": 42, "samples_count": 12288}}
// event_type is POINT_IN_TIME (mllog.event), INTERVAL_START (mllog.start) or INTERVAL_END
// (mllog.end); time_ms is milliseconds since the Unix epoch; metadata opens with the
// caller's file and line (mllog.get_caller, here std::source_location, the path made
// repository-relative by source_file_name) and then holds what the caller adds (epoch_num, samples_count,
// first_epoch_num, epoch_count, status, ...). The checkers find the token anywhere in a
// line (mlp_parser/ruleset_510.py strip_and_dedup), so echoing lines to a console with a
// prefix keeps them readable by the checkers.
//
// A run's lines go to its result file (result_N.txt, as a submission lays them out), each
// appended with one write(2) on a descriptor opened O_APPEND, so a line is never torn or
// interleaved with another writer's, and a crash loses at most the line being written.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <source_location>
#include <string>

namespace forge::mllog {

using Json = nlohmann::ordered_json;

// Keys the MLPerf Training 5.1 rules check (compliance_checker/training_5.1.0/*.yaml) and
// the ones the reference implementations log besides; spelled as mllog/constants.py.
inline constexpr const char* kSubmissionBenchmark = "submission_benchmark";
inline constexpr const char* kSubmissionDivision = "submission_division";
inline constexpr const char* kSubmissionOrg = "submission_org";
inline constexpr const char* kSubmissionPlatform = "submission_platform";
inline constexpr const char* kSubmissionStatus = "submission_status";
inline constexpr const char* kCacheClear = "cache_clear";
inline constexpr const char* kInitStart = "init_start";
inline constexpr const char* kInitStop = "init_stop";
inline constexpr const char* kRunStart = "run_start";
inline constexpr const char* kRunStop = "run_stop";
inline constexpr const char* kBlockStart = "block_start";
inline constexpr const char* kBlockStop = "block_stop";
inline constexpr const char* kEpochStart = "epoch_start";
inline constexpr const char* kEpochStop = "epoch_stop";
inline constexpr const char* kEvalStart = "eval_start";
inline constexpr const char* kEvalStop = "eval_stop";
inline constexpr const char* kEvalAccuracy = "eval_accuracy";
inline constexpr const char* kEvalSamples = "eval_samples";
inline constexpr const char* kEvaluationFrequency = "evaluation_frequency";
inline constexpr const char* kTrainSamples = "train_samples";
inline constexpr const char* kSeed = "seed";
inline constexpr const char* kGlobalBatchSize = "global_batch_size";
inline constexpr const char* kGradientAccumulationSteps = "gradient_accumulation_steps";
inline constexpr const char* kMaxSequenceLength = "max_sequence_length";
inline constexpr const char* kMaxSteps = "max_steps";
inline constexpr const char* kOptName = "opt_name";
inline constexpr const char* kOptBaseLearningRate = "opt_base_learning_rate";
inline constexpr const char* kOptEndLearningRate = "opt_end_learning_rate";
inline constexpr const char* kOptLearningRateWarmupSteps = "opt_learning_rate_warmup_steps";
inline constexpr const char* kOptLearningRateDecaySteps = "opt_learning_rate_decay_steps";
inline constexpr const char* kOptLearningRateDecaySchedule = "opt_learning_rate_decay_schedule";
inline constexpr const char* kOptLearningRateTrainingSteps = "opt_learning_rate_training_steps";
inline constexpr const char* kOptLearningRateWarmupFactor = "opt_learning_rate_warmup_factor";
inline constexpr const char* kOptAdamwBeta1 = "opt_adamw_beta_1";
inline constexpr const char* kOptAdamwBeta2 = "opt_adamw_beta_2";
inline constexpr const char* kOptAdamwEpsilon = "opt_adamw_epsilon";
inline constexpr const char* kOptAdamwWeightDecay = "opt_adamw_weight_decay";
inline constexpr const char* kOptGradientClipNorm = "opt_gradient_clip_norm";
inline constexpr const char* kLoraRank = "lora_rank";
inline constexpr const char* kLoraAlpha = "lora_alpha";
inline constexpr const char* kTrackedStats = "tracked_stats";
// Metadata keys.
inline constexpr const char* kSamplesCount = "samples_count";
inline constexpr const char* kEpochNum = "epoch_num";
inline constexpr const char* kFirstEpochNum = "first_epoch_num";
inline constexpr const char* kEpochCount = "epoch_count";
inline constexpr const char* kStatus = "status";
inline constexpr const char* kStep = "step";
// run_stop's status values.
inline constexpr const char* kSuccess = "success";
inline constexpr const char* kAborted = "aborted";

inline constexpr const char* kLineToken = ":::MLLOG ";

enum class EventType { kPoint, kIntervalStart, kIntervalEnd };
const char* event_type_name(EventType type);  // POINT_IN_TIME, INTERVAL_START, INTERVAL_END

// `value` as Python's json.dumps writes it (NOTE [MLLOG line format]).
std::string dump_like_python(const Json& value);

// The whole line, without a newline: mllog.py's _encode_log.
std::string encode_line(const std::string& name_space, int64_t time_ms, EventType type, const std::string& key,
                        const Json& value, const Json& metadata);

// `file` from its last "src/" (or else "tests/") directory on, leading "../" dropped: the
// repository-relative name mllog's root_dir trimming gives.
std::string source_file_name(const char* file);

class Writer {
 public:
  using Clock = std::function<int64_t()>;  // milliseconds since the Unix epoch
  // Appends to `result_path` (created when missing; an existing file is appended to, as
  // runs retried into one result file are); `echo` also prints every line to stdout.
  // `clock` defaults to the system clock.
  Writer(std::string result_path, bool echo, std::string name_space = "", Clock clock = {});
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // mllog.event / start / end. `metadata` must be a JSON object or null; its keys follow
  // file and lineno.
  void event(const std::string& key, const Json& value = nullptr, const Json& metadata = nullptr,
             std::source_location where = std::source_location::current());
  void start(const std::string& key, const Json& value = nullptr, const Json& metadata = nullptr,
             std::source_location where = std::source_location::current());
  void end(const std::string& key, const Json& value = nullptr, const Json& metadata = nullptr,
           std::source_location where = std::source_location::current());

  const std::string& path() const { return path_; }

 private:
  void write(EventType type, const std::string& key, const Json& value, const Json& metadata,
             const std::source_location& where);

  std::string path_;
  bool echo_;
  std::string name_space_;
  Clock clock_;
  int fd_ = -1;
};

}  // namespace forge::mllog
