// The markdown table and the JSON report of bench results; see bench_report.h.
#include "bench/bench_report.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>

#include "core/durable_file.h"

namespace forge {
namespace {

// A cell's text with the characters that would break a markdown table row escaped.
std::string cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') {
      out += "\\|";
    } else if (c == '\n' || c == '\r') {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

std::string model_cell(const BenchResult& r) {
  if (r.parallelism.empty() || r.parallelism == "single") return r.model;
  return fmt::format("{} with {}", r.model, r.parallelism);
}

std::string upper(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::toupper(c); });
  return text;
}

// Seconds from 1 s up, milliseconds below, with the unit once per cell.
std::string step_time_cell(const BenchResult& r) {
  if (r.step_time_median_s >= 1.0) {
    return fmt::format("{:.2f} s ({:.2f}-{:.2f})", r.step_time_median_s, r.step_time_min_s, r.step_time_max_s);
  }
  return fmt::format("{:.1f} ms ({:.1f}-{:.1f})", 1e3 * r.step_time_median_s, 1e3 * r.step_time_min_s,
                     1e3 * r.step_time_max_s);
}

std::string status_cell(const BenchResult& r) {
  if (r.status == "ok") return "ok";
  if (r.status == "oom") return "OOM";
  return r.error.empty() ? r.status : fmt::format("{}: {}", r.status, r.error);
}

// The bf16-peak MFU, and for FP8 runs the fp8-peak one beside it: "41.2% (FP8 peak 20.6%)".
std::string mfu_cell(const BenchResult& r) {
  std::string text = r.mfu ? fmt::format("{:.1f}%", 100.0 * *r.mfu) : "n/a";
  if (r.fp8 != "none") text += r.mfu_fp8 ? fmt::format(" (FP8 peak {:.1f}%)", 100.0 * *r.mfu_fp8) : " (FP8 peak n/a)";
  return text;
}

}  // namespace

std::string fp8_precision_label(const std::string& recipe, bool routed_experts_bf16, bool weight_gradients_bf16,
                                const std::string& filter_fqns) {
  return fmt::format("FP8 ({}{}{}{})", recipe, routed_experts_bf16 ? ", routed experts bf16" : "",
                     weight_gradients_bf16 ? ", weight gradients bf16" : "",
                     filter_fqns.empty() ? "" : ", bf16: " + filter_fqns);
}

std::string precision_label(const BenchResult& r) {
  if (r.fp8 == "none" || r.fp8.empty()) return upper(r.precision);
  return fp8_precision_label(r.fp8, !r.fp8_routed_experts, !r.fp8_weight_gradient, r.fp8_filter_fqns);
}

std::string bench_markdown_table(const std::vector<BenchResult>& results) {
  std::string table =
      "| Model | Precision | Batch Size | Sequence Length | Accumulation | Checkpointing | TFLOP/s/GPU | Tokens/s/GPU "
      "| Step time (median, min-max) | MFU | Peak memory (GiB) | Status |\n"
      "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|\n";
  for (const BenchResult& r : results) {
    table += fmt::format("| {} | {} | {} | {} | {} | {} ", cell(model_cell(r)), cell(precision_label(r)),
                         r.micro_batch, r.seq_len, r.grad_accum,
                         cell(r.activation_checkpoint.empty() ? "-" : r.activation_checkpoint));
    if (r.status == "ok") {
      table += fmt::format("| {:.2f} | {:.0f} | {} | {} | {} ", r.tflops_per_gpu, r.tokens_per_s_per_gpu,
                           step_time_cell(r), mfu_cell(r),
                           r.peak_memory_bytes > 0 ? fmt::format("{:.2f}", r.peak_memory_bytes / 1073741824.0) : "n/a");
    } else {
      table += "| - | - | - | - | - ";
    }
    table += fmt::format("| {} |\n", cell(status_cell(r)));
  }
  return table;
}

void to_json(nlohmann::json& out, const BenchResult& r) {
  out = nlohmann::json{
      {"model", r.model},
      {"precision", r.precision},
      {"fp8", r.fp8},
      {"fp8_routed_experts", r.fp8_routed_experts},
      {"fp8_filter_fqns", r.fp8_filter_fqns},
      {"fp8_weight_gradient", r.fp8_weight_gradient},
      {"micro_batch", r.micro_batch},
      {"seq_len", r.seq_len},
      {"grad_accum", r.grad_accum},
      {"global_batch", r.global_batch},
      {"n_gpus", r.n_gpus},
      {"parallelism", r.parallelism},
      {"activation_checkpoint", r.activation_checkpoint},
      {"args", r.args},
      {"device_name", r.device_name},
      {"gpu_architecture", r.gpu_architecture},
      {"config", r.config},
      {"status", r.status},
      {"error", r.error},
      {"warmup_steps", r.warmup_steps},
      {"measured_steps", r.measured_steps},
      {"step_time_median_s", r.step_time_median_s},
      {"step_time_min_s", r.step_time_min_s},
      {"step_time_max_s", r.step_time_max_s},
      {"tokens_per_s_per_gpu", r.tokens_per_s_per_gpu},
      {"images_per_s_per_gpu",
       r.images_per_s_per_gpu ? nlohmann::json(*r.images_per_s_per_gpu) : nlohmann::json(nullptr)},
      {"tflops_per_gpu", r.tflops_per_gpu},
      {"mfu", r.mfu ? nlohmann::json(*r.mfu) : nlohmann::json(nullptr)},
      {"mfu_fp8", r.mfu_fp8 ? nlohmann::json(*r.mfu_fp8) : nlohmann::json(nullptr)},
      {"peak_memory_bytes", r.peak_memory_bytes},
      {"duration_s", r.duration_s},
  };
}

void write_bench_json(const std::string& path, const std::vector<BenchResult>& results) {
  write_file_atomic(path, nlohmann::json(results).dump(2) + "\n", {.sync = false});  // NOTE [Durable files]
}

}  // namespace forge
