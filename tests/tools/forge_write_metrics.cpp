// forge_write_metrics RUN_DIR STEPS: writes metrics.jsonl and a TensorBoard event file into
// RUN_DIR through MetricsWriter, with every optional metric set (MFU, peak memory) that
// a CPU training run leaves out, so tests/python/test_tensorboard.py and test_report.py
// can check those too. A run record (model "synthetic-metrics") comes first; step s has
// loss 10/s, MFU s/100, peak memory s GiB + s bytes; an eval follows every fifth step.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "core/error.h"
#include "train/metrics.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: forge_write_metrics RUN_DIR STEPS\n";
    return 2;
  }
  try {
    const std::string run_dir = argv[1];
    const int64_t steps = std::atoll(argv[2]);
    std::filesystem::create_directories(run_dir);
    forge::MetricsWriter metrics(run_dir + "/metrics.jsonl");
    metrics.enable_tensorboard(run_dir, 0);
    metrics.write(nlohmann::json{{"type", "run"}, {"model", "synthetic-metrics"}, {"parameters", 1234567},
                                 {"device", "NVIDIA H100 80GB HBM3"}});
    for (int64_t s = 1; s <= steps; ++s) {
      forge::StepMetrics m;
      m.step = s;
      m.loss = 10.0 / static_cast<double>(s);
      m.lr = 1e-3 * static_cast<double>(s) / static_cast<double>(steps);
      m.grad_norm = 0.5 + 0.01 * static_cast<double>(s);
      m.step_time_s = 0.25;
      m.tokens_per_s = 123456.7 + static_cast<double>(s);
      m.model_tflops = 456.78 + 0.1 * static_cast<double>(s);
      m.mfu = static_cast<double>(s) / 100.0;
      m.peak_memory_bytes = s * (int64_t{1} << 30) + s;
      metrics.write(m);
      if (s % 5 == 0) {
        forge::EvalMetrics e{.step = s, .loss = m.loss + 0.1, .perplexity = std::exp(m.loss + 0.1), .tokens = 1024};
        metrics.write(e);
      }
    }
  } catch (const forge::Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
