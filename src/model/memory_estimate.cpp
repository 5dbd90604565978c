#include "model/memory_estimate.h"

#include <fmt/format.h>

namespace forge {

MemoryEstimate estimate_memory(const ModelConfig& config, const MemoryPlan& plan) {
  const double params = static_cast<double>(config.total_params());
  const DType compute = plan.cuda ? DType::BF16 : DType::F32;
  MemoryEstimate e;
  e.master_weights = params * 4;
  e.compute_weights = plan.cuda ? params * 2 : 0.0;
  e.gradients = params * 4;
  e.optimizer_state = params * 2 * static_cast<double>(dtype_size(plan.optimizer_state));
  e.activations =
      static_cast<double>(activation_bytes(config, plan.micro_batch, plan.seq_len, compute, plan.checkpoint));
  return e;
}

std::string describe(const MemoryEstimate& e) {
  auto gib = [](double b) { return fmt::format("{:.2f} GiB", b / (1024.0 * 1024.0 * 1024.0)); };
  std::string s = fmt::format("master weights {} + ", gib(e.master_weights));
  if (e.compute_weights > 0) s += fmt::format("bf16 weights {} + ", gib(e.compute_weights));
  s += fmt::format("gradients {} + AdamW state {} + activations {} = {}", gib(e.gradients), gib(e.optimizer_state),
                   gib(e.activations), gib(e.total()));
  return s;
}

}  // namespace forge
