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

}  // namespace forge::cuda
