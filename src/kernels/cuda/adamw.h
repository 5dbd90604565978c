#pragma once

#include <cstdint>

#include "kernels/adamw_scalars.h"
#include "kernels/cuda/types.h"

namespace forge::cuda {

// One AdamW step over n fp32 elements (param, grad, m, v). When compute_copy is not null
// it receives the updated parameters rounded to bf16 (the weights the next forward uses).
void adamw_update(float* param, const float* grad, float* m, float* v, bf16* compute_copy, int64_t n,
                  const AdamWScalars& s);

}  // namespace forge::cuda
