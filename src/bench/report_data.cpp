#include "bench/report_data.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/input_file.h"
#include "core/json_input.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The fields of one JSON object, with errors that say where the object came from
// ("runs/a/metrics.jsonl:12", "runs/a/bench.json entry 3").
class Fields {
 public:
  Fields(const json& object, std::string where) : object_(object), where_(std::move(where)) {
    if (!object_.is_object()) FORGE_FAIL("{}: expected a JSON object, found {}", where_, object_.type_name());
  }

  bool has(const char* key) const { return object_.contains(key) && !object_.at(key).is_null(); }

  // null reads as NaN: nlohmann::json writes non-finite doubles (a diverged loss) as null.
  double number(const char* key) const {
    const json& v = required(key);
    if (v.is_null()) return std::numeric_limits<double>::quiet_NaN();
    if (!v.is_number()) FORGE_FAIL("{}: '{}' must be a number, found {}", where_, key, describe_json(v));
    return v.get<double>();
  }
  int64_t integer(const char* key) const {
    const json& v = required(key);
    if (!v.is_number_integer()) FORGE_FAIL("{}: '{}' must be an integer, found {}", where_, key, describe_json(v));
    return v.get<int64_t>();
  }
  std::string string(const char* key) const {
    const json& v = required(key);
    if (!v.is_string()) FORGE_FAIL("{}: '{}' must be a string, found {}", where_, key, describe_json(v));
    return v.get<std::string>();
  }
  std::optional<double> optional_number(const char* key) const {
    return has(key) ? std::optional<double>(number(key)) : std::nullopt;
  }
  void read(const char* key, double& out) const {
    if (has(key)) out = number(key);
  }
  void read(const char* key, int64_t& out) const {
    if (has(key)) out = integer(key);
  }
  void read(const char* key, std::string& out) const {
    if (has(key)) out = string(key);
  }
  void read(const char* key, bool& out) const {
    if (!has(key)) return;
    const json& v = required(key);
    if (!v.is_boolean()) FORGE_FAIL("{}: '{}' must be true or false, found {}", where_, key, describe_json(v));
    out = v.get<bool>();
  }

 private:
  const json& required(const char* key) const {
    if (!object_.contains(key)) FORGE_FAIL("{}: missing '{}'", where_, key);
    return object_.at(key);
  }

  const json& object_;
  std::string where_;
};

StepMetrics step_from(const Fields& f) {
  StepMetrics m;
  m.step = f.integer("step");
  m.loss = f.number("loss");
  m.lr = f.number("lr");
  m.grad_norm = f.number("grad_norm");
  m.step_time_s = f.number("step_time_s");
  m.tokens_per_s = f.number("tokens_per_s");
  m.model_tflops = f.number("model_tflops");
  m.mfu = f.optional_number("mfu");
  m.mfu_fp8 = f.optional_number("mfu_fp8");
  if (f.has("peak_memory_bytes")) m.peak_memory_bytes = f.integer("peak_memory_bytes");
  return m;
}

EvalMetrics eval_from(const Fields& f) {
  EvalMetrics m;
  m.step = f.integer("step");
  m.loss = f.number("loss");
  m.perplexity = f.number("perplexity");
  f.read("tokens", m.tokens);
  return m;
}

template <typename Records>
void drop_after(Records& records, int64_t step) {
  std::erase_if(records, [&](const auto& r) { return r.step > step; });
}

void read_metrics(const std::string& path, ReportRun& run) {
  require_regular_file(path, "the run's metrics");  // NOTE [User files must be regular files]
  std::ifstream in(path);
  if (!in) FORGE_FAIL("cannot read '{}'", path);
  bool have_run_record = false;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    const std::string where = fmt::format("{}:{}", path, number);
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const json record = parse_json(line, where);
    const Fields f(record, where);
    const std::string type = f.string("type");
    if (type == "run") {
      run.model = f.string("model");
      run.parameters = f.integer("parameters");
      f.read("device", run.device);
      have_run_record = true;
    } else if (type == "train") {
      run.steps.push_back(step_from(f));
    } else if (type == "eval") {
      run.evals.push_back(eval_from(f));
    } else if (type == "resume") {
      const int64_t step = f.integer("step");
      drop_after(run.steps, step);
      drop_after(run.evals, step);
    }
  }
  if (!have_run_record) FORGE_FAIL("{}: no run record ({{\"type\": \"run\", ...}}): not a forge run's metrics", path);
  auto by_step = [](const auto& a, const auto& b) { return a.step < b.step; };
  std::stable_sort(run.steps.begin(), run.steps.end(), by_step);
  std::stable_sort(run.evals.begin(), run.evals.end(), by_step);
}

std::optional<int64_t> yaml_integer(const YAML::Node& root, const char* section, const char* key,
                                    const std::string& path) {
  const YAML::Node node = root[section][key];
  if (!node) return std::nullopt;
  try {
    return node.as<int64_t>();
  } catch (const YAML::Exception&) {
    FORGE_FAIL("{}: {}.{} must be an integer, found '{}'", path, section, key, node.Scalar());
  }
}

// The lookups are inside the try too: yaml-cpp throws when a section is a scalar or a list
// ("training: 5"), not only when the text is not YAML.
void read_config(const std::string& path, ReportRun& run) {
  const std::string text = read_regular_file(path, "the run's config");
  try {
    const YAML::Node root = YAML::Load(text);
    if (!root.IsMap()) FORGE_FAIL("{}: expected a YAML mapping of config sections", path);
    run.micro_batch = yaml_integer(root, "training", "local_batch_size", path);
    run.grad_accum = yaml_integer(root, "training", "gradient_accumulation_steps", path);
    run.global_batch = yaml_integer(root, "training", "global_batch_size", path);
    run.seq_len = yaml_integer(root, "training", "seq_len", path);
    if (const YAML::Node dtype = root["precision"]["compute_dtype"]) {
      if (!dtype.IsScalar()) FORGE_FAIL("{}: precision.compute_dtype must be a name", path);
      run.precision = dtype.Scalar();
    }
    if (const YAML::Node fp8 = root["precision"]["fp8"]) {
      if (!fp8.IsScalar()) FORGE_FAIL("{}: precision.fp8 must be a name", path);
      // NOTE [FP8 routed experts switch]: labelled as precision_label does (bench_report.h).
      const YAML::Node experts = root["precision"]["fp8_routed_experts"];
      const bool bf16_experts = experts && experts.IsScalar() && experts.Scalar() == "false" &&
                                root["model"]["num_experts"] && root["model"]["num_experts"].Scalar() != "0";
      // NOTE [FP8 weight gradient switch] and NOTE [FP8 filter]: the GEMMs kept out of FP8.
      const YAML::Node weight_gradient = root["precision"]["fp8_weight_gradient"];
      const bool bf16_weight_gradients =
          weight_gradient && weight_gradient.IsScalar() && weight_gradient.Scalar() == "false";
      const YAML::Node filter = root["precision"]["fp8_filter_fqns"];
      if (fp8.Scalar() != "none")
        run.precision = fp8_precision_label(fp8.Scalar(), bf16_experts, bf16_weight_gradients,
                                            filter && filter.IsScalar() ? filter.Scalar() : std::string());
    }
  } catch (const YAML::Exception& e) {
    FORGE_FAIL("{}: not a readable config: {}", path, e.what());
  }
}

BenchResult bench_from(const Fields& f) {
  BenchResult r;
  r.model = f.string("model");
  r.status = f.string("status");
  f.read("precision", r.precision);
  f.read("micro_batch", r.micro_batch);
  f.read("seq_len", r.seq_len);
  f.read("grad_accum", r.grad_accum);
  f.read("global_batch", r.global_batch);
  f.read("n_gpus", r.n_gpus);
  f.read("parallelism", r.parallelism);
  f.read("activation_checkpoint", r.activation_checkpoint);
  f.read("device_name", r.device_name);
  f.read("error", r.error);
  f.read("step_time_median_s", r.step_time_median_s);
  f.read("tokens_per_s_per_gpu", r.tokens_per_s_per_gpu);
  f.read("tflops_per_gpu", r.tflops_per_gpu);
  r.mfu = f.optional_number("mfu");
  f.read("fp8", r.fp8);  // absent from reports written before precision.fp8
  f.read("fp8_routed_experts", r.fp8_routed_experts);  // absent before the switch: true
  f.read("fp8_filter_fqns", r.fp8_filter_fqns);        // absent before the filter: none
  f.read("fp8_weight_gradient", r.fp8_weight_gradient);  // absent before the switch: true
  r.mfu_fp8 = f.optional_number("mfu_fp8");
  f.read("peak_memory_bytes", r.peak_memory_bytes);
  return r;
}

}  // namespace

std::vector<BenchResult> load_bench_results(const std::string& path) {
  const json entries = read_json_file(path, "benchmark results");
  if (!entries.is_array()) FORGE_FAIL("{}: expected a JSON array of benchmark results, found {}", path, entries.type_name());
  std::vector<BenchResult> results;
  for (size_t i = 0; i < entries.size(); ++i) results.push_back(bench_from(Fields(entries[i], fmt::format("{} entry {}", path, i + 1))));
  return results;
}

ReportRun load_report_run(const std::string& dir) {
  std::error_code error;
  if (!fs::is_directory(dir, error)) FORGE_FAIL("run directory '{}' not found (or not a directory)", dir);
  const std::string metrics = (fs::path(dir) / "metrics.jsonl").string();
  const std::string bench = (fs::path(dir) / "bench.json").string();
  ReportRun run;
  run.dir = dir;
  run.has_metrics = fs::is_regular_file(metrics, error);
  if (!run.has_metrics && !fs::exists(bench, error))
    FORGE_FAIL("'{}' holds no metrics.jsonl (nor bench.json): not a forge run directory (forge train writes "
               "metrics.jsonl into logging.run_dir, forge bench writes bench.json into its --output-dir)",
               dir);
  if (run.has_metrics) {
    read_metrics(metrics, run);
    const std::string config = (fs::path(dir) / "config.yaml").string();
    if (fs::exists(config, error)) read_config(config, run);
  }
  if (fs::exists(bench, error)) run.bench = load_bench_results(bench);
  return run;
}

}  // namespace forge
