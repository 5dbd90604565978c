// NOTE [Loss spikes] (train/loss_spike.h).
#include "train/loss_spike.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace forge {
namespace {

constexpr const char* kScaleVariable = "FORGE_TEST_SCALE_LOSS";

}  // namespace

LossSpikeDetector::LossSpikeDetector(double factor, int64_t window) : factor_(factor), window_(window) {
  FORGE_CHECK(factor == 0 || factor > 1, "loss spike factor {} is neither 0 nor above 1", factor);
  FORGE_CHECK(window >= 1, "loss spike window {} is below 1", window);
}

LossSpikeDetector::Verdict LossSpikeDetector::observe(double loss) {
  Verdict v;
  if (!enabled()) return v;
  const int64_t held = static_cast<int64_t>(recent_.size());
  if (held >= std::min(window_, kLossSpikeWarmup)) {
    double sum = 0;
    for (double l : recent_) sum += l;
    v.mean = sum / static_cast<double>(held);
    v.count = held;
    v.spike = loss > factor_ * v.mean;
  }
  if (!v.spike) {
    recent_.push_back(loss);
    if (static_cast<int64_t>(recent_.size()) > window_) recent_.pop_front();
  }
  return v;
}

void LossSpikeDetector::restore(const std::vector<double>& losses) {
  const size_t keep = std::min(losses.size(), static_cast<size_t>(window_));
  recent_.assign(losses.end() - static_cast<std::ptrdiff_t>(keep), losses.end());
}

std::optional<LossScaling> loss_scaling_from_env() {
  const char* raw = std::getenv(kScaleVariable);
  if (!raw || !*raw) return std::nullopt;
  const std::string value = raw;
  const size_t colon = value.find(':');
  LossScaling s;
  bool ok = colon != std::string::npos;
  if (ok) {
    const char* begin = value.data();
    auto [end, error] = std::from_chars(begin, begin + colon, s.step);
    ok = error == std::errc() && end == begin + colon && s.step >= 1;
    auto [fend, ferror] = std::from_chars(begin + colon + 1, begin + value.size(), s.factor);
    ok = ok && ferror == std::errc() && fend == begin + value.size() && std::isfinite(s.factor) && s.factor > 0;
  }
  if (!ok) FORGE_FAIL("{}='{}': expected STEP:FACTOR (a step >= 1, a positive factor)", kScaleVariable, value);
  return s;
}

}  // namespace forge
