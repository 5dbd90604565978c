#include "train/nonfinite.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "core/error.h"
#include "ops/elementwise.h"

namespace forge {
namespace {

constexpr const char* kInjectVariable = "FORGE_TEST_INJECT_NAN";

int64_t parse_count(const std::string& text, const std::string& value, const char* what) {
  int64_t n = -1;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (error != std::errc() || end != text.data() + text.size() || n < 0)
    FORGE_FAIL("{}='{}': the {} '{}' is not a non-negative integer (expected STEP:TENSOR[:MICRO_BATCH])",
               kInjectVariable, value, what, text);
  return n;
}

}  // namespace

std::optional<NanInjection> nan_injection_from_env() {
  const char* raw = std::getenv(kInjectVariable);
  if (!raw || !*raw) return std::nullopt;
  const std::string value = raw;
  const size_t first = value.find(':');
  if (first == std::string::npos)
    FORGE_FAIL("{}='{}': expected STEP:TENSOR[:MICRO_BATCH]", kInjectVariable, value);
  NanInjection injection;
  injection.step = parse_count(value.substr(0, first), value, "step");
  std::string rest = value.substr(first + 1);
  const size_t second = rest.rfind(':');
  if (second != std::string::npos) {
    injection.micro_batch = parse_count(rest.substr(second + 1), value, "micro-batch");
    rest = rest.substr(0, second);
  }
  constexpr std::string_view kAmax = "@fp8_amax";
  if (rest.size() > kAmax.size() && rest.ends_with(kAmax)) {
    injection.fp8_amax = true;
    rest.resize(rest.size() - kAmax.size());
  }
  if (rest.empty()) FORGE_FAIL("{}='{}': the tensor name is empty", kInjectVariable, value);
  injection.tensor = rest;
  return injection;
}

int64_t first_nonfinite_tensor(const std::vector<Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (!t.defined() || t.numel() == 0) continue;
    Tensor host = t.to(Device::CPU);
    if (host.dtype() != DType::F32) {
      Tensor wide = Tensor::empty(host.shape(), DType::F32);
      cast(wide, host);
      host = wide;
    }
    const float* p = host.data<float>();
    for (int64_t j = 0; j < host.numel(); ++j)
      if (!std::isfinite(p[j])) return static_cast<int64_t>(i);
  }
  return -1;
}

void poison_first_element(const Tensor& t) {
  if (t.numel() == 0) return;
  Tensor one = t.view({t.numel()}).narrow(0, 1);
  Tensor host = Tensor::empty(one.shape(), DType::F32);
  host.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  one.copy_from(host.to(t.device()));
}

}  // namespace forge
