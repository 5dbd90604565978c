#include "ops/fp8_statistics.h"

#include "core/error.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/fp8_delayed.h"
#endif

namespace forge {

int64_t fp8_stats_projections(const Tensor& stats) {
  FORGE_CHECK(stats.dtype() == DType::F32 && stats.numel() % cpu::kFp8ProjectionStats == 0,
              "FP8 statistics: expected f32 blocks of {} floats, got {} {}", cpu::kFp8ProjectionStats,
              dtype_name(stats.dtype()), stats.numel());
  return stats.numel() / cpu::kFp8ProjectionStats;
}

void fp8_stats_init(const Tensor& stats) {
  const int64_t n = fp8_stats_projections(stats);
  if (stats.device() == Device::CPU) return cpu::fp8_init_stats(stats.data<float>(), n);
  FORGE_CUDA_CALL("fp8_stats_init", cuda::fp8_init_stats(stats.data<float>(), n));
}

int64_t fp8_stats_first_nonfinite(const Tensor& stats) {
  const int64_t n = fp8_stats_projections(stats);
  if (stats.device() == Device::CPU) return cpu::fp8_first_nonfinite_seen(stats.data<float>(), n);
  FORGE_CUDA_CALL("fp8_stats_first_nonfinite", return cuda::fp8_first_nonfinite_seen(stats.data<float>(), n));
}

float fp8_stats_seen(const Tensor& stats, int64_t slot) {
  const int64_t offset = cpu::fp8_seen_offset(slot / cpu::kFp8Roles, static_cast<cpu::Fp8Role>(slot % cpu::kFp8Roles));
  FORGE_CHECK(slot >= 0 && offset < stats.numel(), "FP8 statistics: slot {} out of range", slot);
  return stats.narrow(offset, offset + 1).to(Device::CPU).data<float>()[0];
}

void fp8_stats_delayed_step(const Tensor& stats, const Tensor& history, const cpu::Fp8DelayedRecipe& recipe) {
  const int64_t n = fp8_stats_projections(stats);
  FORGE_CHECK(recipe.history_length >= 1 && history.dtype() == DType::F32 &&
                  history.numel() == n * cpu::kFp8Roles * recipe.history_length && history.device() == stats.device(),
              "FP8 delayed scaling: the amax histories hold {} values, expected {} projections x {} x {}",
              history.numel(), n, cpu::kFp8Roles, recipe.history_length);
  if (stats.device() == Device::CPU)
    return cpu::fp8_delayed_step(stats.data<float>(), history.data<float>(), n, recipe);
  FORGE_CUDA_CALL("fp8_stats_delayed_step",
                  cuda::fp8_delayed_step(stats.data<float>(), history.data<float>(), n, recipe));
}

void fp8_stats_clear_seen(const Tensor& stats) {
  const int64_t n = fp8_stats_projections(stats);
  if (stats.device() == Device::CPU) return cpu::fp8_clear_seen(stats.data<float>(), n);
  FORGE_CUDA_CALL("fp8_stats_clear_seen", cuda::fp8_clear_seen(stats.data<float>(), n));
}

}  // namespace forge
