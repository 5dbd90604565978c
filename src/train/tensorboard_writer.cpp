#include "train/tensorboard_writer.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/protobuf_wire.h"
#include "train/tfrecord.h"

namespace forge {
namespace {

// NOTE [TensorBoard event fields]
// The field numbers of the messages written, from TensorFlow's
// tensorflow/core/util/event.proto and tensorflow/core/framework/summary.proto:
//   Event       wall_time = 1 (double, seconds since the epoch), step = 2 (int64),
//               file_version = 3 (string), summary = 5 (Summary), session_log = 7 (SessionLog)
//   Summary     value = 1 (repeated Summary.Value)
//   Value       tag = 1 (string), simple_value = 2 (float)
//   SessionLog  status = 1 (enum; START = 1)
enum EventField { kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7 };
enum SummaryField { kValue = 1 };
enum ValueField { kTag = 1, kSimpleValue = 2 };
enum SessionLogField { kStatus = 1 };
constexpr uint64_t kSessionStart = 1;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// events.out.tfevents.<seconds>.<host>, with a numeric suffix if a run resumed within
// the same second already took that name.
std::string event_file_path(const std::string& run_dir) {
  const std::string base = fmt::format("{}/events.out.tfevents.{}.{}", run_dir, static_cast<int64_t>(unix_seconds()),
                                       host_name());
  std::string path = base;
  for (int n = 1; std::filesystem::exists(path); ++n) path = fmt::format("{}.{}", base, n);
  return path;
}

ProtoWriter event_header(int64_t step) {
  ProtoWriter event;
  event.add_double(kWallTime, unix_seconds());
  event.add_varint(kStep, static_cast<uint64_t>(step));
  return event;
}

std::string scalars_event(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  ProtoWriter summary;
  for (const auto& [tag, value] : scalars) {
    ProtoWriter v;
    v.add_bytes(kTag, tag);
    v.add_float(kSimpleValue, static_cast<float>(value));
    summary.add_bytes(kValue, v.bytes());
  }
  ProtoWriter event = event_header(step);
  event.add_bytes(kSummary, summary.bytes());
  return event.bytes();
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& run_dir, int64_t resumed_from_step)
    : path_(event_file_path(run_dir)), out_(path_, std::ios::binary) {
  if (!out_) FORGE_FAIL("cannot create TensorBoard event file '{}' (logging.enable_tensorboard)", path_);
  ProtoWriter version;
  version.add_double(kWallTime, unix_seconds());
  version.add_bytes(kFileVersion, "brain.Event:2");
  write_event(version.bytes());
  if (resumed_from_step > 0) {
    ProtoWriter status;
    status.add_varint(kStatus, kSessionStart);
    ProtoWriter event = event_header(resumed_from_step + 1);
    event.add_bytes(kSessionLog, status.bytes());
    write_event(event.bytes());
  }
}

void TensorBoardWriter::write_event(const std::string& event) {
  const std::string record = tfrecord(event);
  out_.write(record.data(), static_cast<std::streamsize>(record.size()));
  out_.flush();
  if (!out_) FORGE_FAIL("failed writing TensorBoard event file '{}'", path_);
}

void TensorBoardWriter::write(const StepMetrics& m) {
  std::vector<std::pair<std::string, double>> scalars = {{"train/loss", m.loss},
                                                         {"train/lr", m.lr},
                                                         {"train/grad_norm", m.grad_norm},
                                                         {"throughput/tokens_per_s", m.tokens_per_s},
                                                         {"throughput/model_tflops", m.model_tflops}};
  if (m.mfu) scalars.emplace_back("throughput/mfu_percent", *m.mfu * 100.0);
  if (m.peak_memory_bytes) scalars.emplace_back("memory/peak_gib", static_cast<double>(*m.peak_memory_bytes) / kGiB);
  if (m.comm_exposed_s) scalars.emplace_back("throughput/exposed_comm_ms", *m.comm_exposed_s * 1e3);
  if (!m.expert_load.empty()) scalars.emplace_back("moe/load_max_over_mean", m.expert_load_max_over_mean());
  if (m.expert_dropped_share) scalars.emplace_back("moe/dropped_share", *m.expert_dropped_share);
  write_event(scalars_event(m.step, scalars));
}

void TensorBoardWriter::write(const EvalMetrics& m) {
  write_event(scalars_event(m.step, {{"eval/loss", m.loss}, {"eval/perplexity", m.perplexity}}));
}

}  // namespace forge
