#pragma once

#include "core/tensor.h"
#include "kernels/adamw_scalars.h"

namespace forge::cpu {

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWScalars& s);

}  // namespace forge::cpu
