// What a kernel producing a bf16 tensor can also do for the FP8 projection that quantizes
// it next (NOTE [FP8 fused producers] in ops/fp8_linear.h): fold the output's amax into a
// device float, and cast it to E4M3 codes with a scale already on the device, in the pass
// that writes it. Host-side plain pointers; the kernels that take one: rmsnorm_forward,
// swiglu_forward, swiglu_backward (amax only).
#pragma once

#include <cstdint>

namespace forge::cuda {

struct Fp8Epilogue {
  float* amax = nullptr;         // max |out| folded in (NaN winning); null: no epilogue
  const float* scale = nullptr;  // with codes: the scale the codes are cast with
  uint8_t* codes = nullptr;      // null, or E4M3 codes of out, row-major like out
};

}  // namespace forge::cuda
