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

std::vector<LossScaling> loss_scalings_from_env() {
  const char* raw = std::getenv(kScaleVariable);
  std::vector<LossScaling> scalings;
  if (!raw || !*raw) return scalings;
  const std::string value = raw;
  for (size_t begin = 0; begin <= value.size();) {
    const size_t comma = std::min(value.find(',', begin), value.size());
    const std::string item = value.substr(begin, comma - begin);
    const size_t colon = item.find(':');
    LossScaling s;
    bool ok = colon != std::string::npos;
    if (ok) {
      const char* p = item.data();
      auto [end, error] = std::from_chars(p, p + colon, s.step);
      ok = error == std::errc() && end == p + colon && s.step >= 1;
      auto [fend, ferror] = std::from_chars(p + colon + 1, p + item.size(), s.factor);
      ok = ok && ferror == std::errc() && fend == p + item.size() && std::isfinite(s.factor) && s.factor > 0;
    }
    if (!ok)
      FORGE_FAIL("{}='{}': '{}' is not STEP:FACTOR (a step >= 1, a positive factor; several separated by commas)",
                 kScaleVariable, value, item);
    scalings.push_back(s);
    begin = comma + 1;
  }
  return scalings;
}

}  // namespace forge
