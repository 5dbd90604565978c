#include "train/metrics.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "train/tensorboard_writer.h"

namespace forge {

std::optional<double> peak_tflops(const std::string& device_name) {
  // ../shared/PERF.md: H100 SXM and H200 dense bf16 peak.
  if (device_name.find("H100") != std::string::npos || device_name.find("H200") != std::string::npos) return 989.0;
  return std::nullopt;
}

std::optional<double> peak_fp8_tflops(const std::string& device_name) {
  // ../shared/PERF.md: H100 SXM and H200 dense fp8 peak (twice bf16's).
  if (device_name.find("H100") != std::string::npos || device_name.find("H200") != std::string::npos) return 1979.0;
  return std::nullopt;
}

double StepMetrics::expert_load_max_over_mean() const {
  double worst = 0.0;
  for (const std::vector<int64_t>& block : expert_load) {
    int64_t total = 0, most = 0;
    for (int64_t n : block) {
      total += n;
      most = std::max(most, n);
    }
    if (total > 0) worst = std::max(worst, static_cast<double>(most) * static_cast<double>(block.size()) / total);
  }
  return worst;
}

std::string format_step(const StepMetrics& m, int64_t total_steps) {
  std::string mfu = m.mfu ? fmt::format("{:5.1f}%", *m.mfu * 100.0) : std::string("  n/a");
  return fmt::format("step {:>{}}/{} | loss {:8.4f} | lr {:.3e} | grad norm {:7.3f} | {:9.0f} tok/s | {:8.1f} ms | "
                     "{:7.3f} TFLOP/s | MFU {}",
                     m.step, std::to_string(total_steps).size(), total_steps, m.loss, m.lr, m.grad_norm,
                     m.tokens_per_s, m.step_time_s * 1e3, m.model_tflops, mfu) +
         (m.mfu_fp8 ? fmt::format(" (FP8 peak {:.1f}%)", *m.mfu_fp8 * 100.0) : std::string()) +
         (m.comm_exposed_s ? fmt::format(" | exposed comm {:.1f} ms", *m.comm_exposed_s * 1e3) : std::string()) +
         (m.expert_load.empty() ? std::string()
                                : fmt::format(" | MoE load max/mean {:.2f}", m.expert_load_max_over_mean())) +
         (m.expert_dropped_share ? fmt::format(" | MoE dropped {:.2f}%", *m.expert_dropped_share * 100.0)
                                 : std::string());
}

std::string format_op_seconds(const StepMetrics& m) {
  constexpr size_t kTopOps = 8;
  const auto& seconds = *m.op_seconds;
  std::string s = "  time by op class:";
  double covered = 0;
  for (int c = 0; c < kOpClassCount; ++c) {
    s += fmt::format(" {} {:.1f} ms ({:.0f}%),", op_class_name(static_cast<OpClass>(c)), seconds[c] * 1e3,
                     100 * seconds[c] / m.step_time_s);
    covered += seconds[c];
  }
  s += fmt::format(" other {:.1f} ms\n  slowest ops:", (m.step_time_s - covered) * 1e3);
  std::vector<std::pair<double, std::string>> ops;
  for (const auto& [name, t] : m.op_seconds_by_op) ops.emplace_back(t, name);
  std::sort(ops.rbegin(), ops.rend());
  for (size_t i = 0; i < std::min(kTopOps, ops.size()); ++i)
    s += fmt::format(" {} {:.1f} ms,", ops[i].second, ops[i].first * 1e3);
  s.pop_back();
  return s;
}

std::string format_eval(const EvalMetrics& m, double entropy_floor) {
  std::string s = fmt::format("eval step {} | loss {:.4f} | perplexity {:.3f}", m.step, m.loss, m.perplexity);
  if (entropy_floor > 0) s += fmt::format(" | floor {:.4f} (gap {:+.4f})", entropy_floor, m.loss - entropy_floor);
  return s;
}

MetricsWriter::MetricsWriter(const std::string& path) : path_(path), out_(path, std::ios::app) {
  if (!out_) FORGE_FAIL("cannot open metrics file '{}' for writing", path);
}

MetricsWriter::~MetricsWriter() = default;

void MetricsWriter::enable_tensorboard(const std::string& run_dir, int64_t resumed_from_step) {
  tensorboard_ = std::make_unique<TensorBoardWriter>(run_dir, resumed_from_step);
}

void MetricsWriter::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
  if (!out_) FORGE_FAIL("failed writing metrics file '{}'", path_);
}

void MetricsWriter::write(const StepMetrics& m) {
  nlohmann::json j = {{"type", "train"},      {"step", m.step},
                      {"loss", m.loss},       {"lr", m.lr},
                      {"grad_norm", m.grad_norm}, {"step_time_s", m.step_time_s},
                      {"tokens_per_s", m.tokens_per_s}, {"model_tflops", m.model_tflops}};
  j["mfu"] = m.mfu ? nlohmann::json(*m.mfu) : nlohmann::json(nullptr);
  if (m.mfu_fp8) j["mfu_fp8"] = *m.mfu_fp8;
  if (m.peak_memory_bytes) j["peak_memory_bytes"] = *m.peak_memory_bytes;
  if (m.comm_exposed_s) j["comm_exposed_s"] = *m.comm_exposed_s;
  if (m.skipped) j["skipped"] = true;
  if (m.skipped_steps > 0) j["skipped_steps"] = m.skipped_steps;
  if (m.loss_spike_mean) {
    j["loss_spike"] = true;
    j["loss_spike_mean"] = *m.loss_spike_mean;
  }
  if (m.loss_spikes > 0) j["loss_spikes"] = m.loss_spikes;
  if (!m.expert_load.empty()) {
    j["expert_load"] = m.expert_load;
    j["expert_load_max_over_mean"] = m.expert_load_max_over_mean();
  }
  if (m.expert_dropped_share) j["expert_dropped_share"] = *m.expert_dropped_share;
  if (m.op_seconds) {
    nlohmann::json ops;
    for (int c = 0; c < kOpClassCount; ++c) ops[std::string(op_class_name(static_cast<OpClass>(c)))] = (*m.op_seconds)[c];
    j["op_seconds"] = ops;
    j["op_seconds_by_op"] = m.op_seconds_by_op;
  }
  write(j);
  if (tensorboard_) tensorboard_->write(m);
}

void MetricsWriter::write(const EvalMetrics& m) {
  write(nlohmann::json{{"type", "eval"}, {"step", m.step}, {"loss", m.loss}, {"perplexity", m.perplexity},
                       {"tokens", m.tokens}});
  if (tensorboard_) tensorboard_->write(m);
}

}  // namespace forge
