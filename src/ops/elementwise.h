// Small elementwise ops on same-shaped tensors: fp32 on the CPU; on CUDA bf16 or fp32
// (NOTE [Op placement]).
#pragma once

#include "core/tensor.h"

namespace forge {

// a += b
void add_inplace(const Tensor& a, const Tensor& b);
// out = a + b
void add(const Tensor& out, const Tensor& a, const Tensor& b);
// a *= s
void scale_inplace(const Tensor& a, float s);
// sum of squares of all elements, accumulated in double (for the global grad norm)
double sum_of_squares(const Tensor& a);
// out = in converted between fp32 and bf16 (same device, same element count)
void cast(const Tensor& out, const Tensor& in);

}  // namespace forge
