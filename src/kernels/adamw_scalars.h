// The fp32 scalars of one AdamW step, shared by the CPU and CUDA kernels, already rounded
// from their double formulas (NOTE [AdamW arithmetic as torch does it] in ops/adamw.h).
#pragma once

#include <cstdint>

namespace forge {

struct AdamWScalars {
  float grad_scale;             // global-norm clip coefficient (1: none), applied as g * grad_scale
  float decay_factor;           // 1 - lr * weight_decay
  float one_minus_beta1;        // lerp weight of the first moment
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;  // (1 - beta2^step)^0.5
  float eps;
  float neg_step_size;          // -lr / (1 - beta1^step)
};

// Where a bf16 param's random rounding bits come from (NOTE [Stochastic rounding to bf16]
// in kernels/stochastic_rounding.h): element i of the call is flat element offset + i of
// the stream (seed, step).
struct AdamWRounding {
  uint64_t seed;
  uint64_t step;
  uint64_t offset;
};

}  // namespace forge
