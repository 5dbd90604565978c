#pragma once

#include <cstdint>

#include "kernels/adamw_scalars.h"
#include "kernels/cuda/types.h"

namespace forge::cuda {

// One AdamW step over n elements: fp32 param and grad, moments m and v fp32 or (with
// bf16_moments) bf16. When compute_copy is not null it receives the updated parameters
// rounded to bf16 (the weights the next forward uses).
void adamw_update(float* param, const float* grad, void* m, void* v, bool bf16_moments, void* compute_copy,
                  int64_t n, const AdamWScalars& s);

// The same step of a bf16 param (no fp32 master): each element widened, updated in fp32 and
// rounded stochastically as `rounding` says (NOTE [Stochastic rounding to bf16]).
void adamw_update_bf16_param(void* param, const float* grad, void* m, void* v, bool bf16_moments, int64_t n,
                             const AdamWScalars& s, const AdamWRounding& rounding);

}  // namespace forge::cuda
