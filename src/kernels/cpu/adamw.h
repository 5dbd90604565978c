#pragma once

#include "core/tensor.h"
#include "kernels/adamw_scalars.h"

namespace forge::cpu {

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWScalars& s);

// The same update of a bf16 param (widened, updated in fp32, rounded stochastically).
void adamw_update_bf16_param(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                             const AdamWScalars& s, const AdamWRounding& rounding);

}  // namespace forge::cpu
