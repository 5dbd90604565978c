// Small elementwise ops on same-shaped fp32 tensors.
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

}  // namespace forge
