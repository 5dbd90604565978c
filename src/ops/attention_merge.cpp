#include "ops/attention_merge.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/attention_merge.h"
#endif

namespace forge {

void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out, const Tensor& part_lse,
                     bool token_major) {
  OpProfileScope profile(OpClass::Attention, "attention_merge");
  FORGE_CHECK(out.ndim() == 4, "attention_merge: out {} must be [B, L, H, D]", shape_str(out.shape()));
  const int64_t b = out.dim(0), l = out.dim(1), h = out.dim(2), d = out.dim(3);
  check_shape(lse, {b, h, l}, "attention_merge lse");
  check_shape(part_out, out.shape(), "attention_merge part_out");
  check_shape(part_lse, {b, h, l}, "attention_merge part_lse");
  const Device device = out.device();
  expect_tensor(out, device, DType::F32, "attention_merge out");
  expect_tensor(lse, device, DType::F32, "attention_merge lse");
  expect_tensor(part_lse, device, DType::F32, "attention_merge part_lse");
  if (device == Device::CUDA) {
    expect_tensor(part_out, device, DType::BF16, "attention_merge part_out");
    FORGE_CUDA_CALL("attention_merge", cuda::attention_merge(out.data<float>(), lse.data<float>(),
                                                             bf16_ptr(part_out), part_lse.data<float>(), b, l, h, d,
                                                             token_major));
    return;
  }
  expect_tensor(part_out, device, DType::F32, "attention_merge part_out");
  float* o = out.data<float>();
  float* s = lse.data<float>();
  const float* po = part_out.data<float>();
  const float* ps = part_lse.data<float>();
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < h; ++hi)
      for (int64_t i = 0; i < l; ++i) {
        const int64_t stat = token_major ? (bi * l + i) * h + hi : (bi * h + hi) * l + i;
        float& running = s[stat];
        const float other = ps[stat];
        if (other == kNone) continue;
        const float m = std::max(running, other);
        const float merged = running == kNone ? other : m + std::log(std::exp(running - m) + std::exp(other - m));
        const float keep = running == kNone ? 0.0f : std::exp(running - merged), add = std::exp(other - merged);
        float* row = o + ((bi * l + i) * h + hi) * d;
        const float* part = po + ((bi * l + i) * h + hi) * d;
        for (int64_t k = 0; k < d; ++k) row[k] = keep * row[k] + add * part[k];
        running = merged;
      }
}

}  // namespace forge
