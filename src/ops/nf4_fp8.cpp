#include "ops/nf4_fp8.h"

#include "core/error.h"
#include "kernels/cpu/fp8_scaling.h"
#include "ops/nf4.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/fp8_weight_chunk.h"
#include "kernels/cuda/nf4_fp8.h"
#endif

namespace forge {
namespace {

using cpu::Fp8Role;
constexpr int64_t kStride = cpu::kFp8StatStride;

}  // namespace

bool nf4_fp8_straight(const LinearWeight& w) {
#ifdef FORGE_CUDA
  return w.nf4 && w.fp8 && !w.fp8_gathered && w.weight.device() == Device::CUDA && !w.nf4->row_order.defined() &&
         w.fp8->workspace && w.fp8->workspace->nf4_stats.numel() >= 3 * kStride;
#else
  (void)w;
  return false;
#endif
}

Nf4Fp8Codes nf4_fp8_codes(const LinearWeight& w) {
  FORGE_CHECK(nf4_fp8_straight(w), "nf4_fp8_codes: needs an NF4 weight on CUDA with FP8 settings and nf4_stats");
  const Tensor& scratch = w.weight;
  FORGE_CHECK(scratch.ndim() == 2 && scratch.dtype() == DType::BF16 && shape_numel(w.nf4->shape()) == scratch.numel(),
              "nf4_fp8_codes: the scratch {} ({}) does not hold the NF4 weight {}", shape_str(scratch.shape()),
              dtype_name(scratch.dtype()), shape_str(w.nf4->shape()));
  Nf4Fp8Codes result;
  result.codes = Tensor::wrap(scratch.raw(), scratch.shape(), DType::U8, Device::CUDA);
#ifdef FORGE_CUDA
  const Fp8Linear& fp8 = *w.fp8;
  float* slot = fp8.workspace->nf4_stats.data<float>();  // amax, scale, scale_inv: 256 bytes apart
  float* amax = slot;
  device_memset_zero_on(amax, sizeof(float), nullptr);
  const bool delayed = fp8_uses_delayed_scales(fp8);
  float* scale = slot + kStride;
  float* scale_inv = slot + 2 * kStride;
  if (delayed) {  // W's delayed scale in the projection's block (NOTE [FP8 delayed scaling])
    float* seen = fp8_seen_of(fp8, Fp8Role::W);
    scale = seen + kStride;
    scale_inv = seen + 2 * kStride;
  } else {
    for (const Nf4Tensor& part : w.nf4->parts)
      cuda::nf4_fp8_amax(part.codes.data<uint8_t>(), part.absmax_codes.data<uint8_t>(),
                         part.absmax_scales.data<float>(), part.absmax_offset, part.numel(), amax);
    if (Fp8AmaxGroup* group = fp8_amax_group_of(fp8, Fp8Role::W)) {  // as the FP8 op's agree_amax
      if (float* seen = fp8_seen_of(fp8, Fp8Role::W)) cuda::fp8_fold_amax(amax, seen, nullptr);
      group->all_reduce_max(Tensor::wrap(amax, {1}, DType::F32, Device::CUDA));
    }
    cuda::fp8_chunk_scales(amax, 1, scale, scale_inv, kStride, nullptr);
  }
  uint8_t* out = result.codes.data<uint8_t>();
  for (const Nf4Tensor& part : w.nf4->parts) {
    cuda::nf4_fp8_cast(part.codes.data<uint8_t>(), part.absmax_codes.data<uint8_t>(), part.absmax_scales.data<float>(),
                       part.absmax_offset, part.numel(), scale, out, delayed ? amax : nullptr);
    out += part.numel();
  }
  result.cast = {amax, scale, scale_inv};
#endif
  return result;
}

}  // namespace forge
