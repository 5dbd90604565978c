// Whole-tensor helpers: the sum of squares behind the global grad norm, and fp32 <-> bf16
// casts (NOTE [Op placement]).
#pragma once

#include "core/tensor.h"

namespace forge {

// sum of squares of all elements, accumulated in double (for the global grad norm)
double sum_of_squares(const Tensor& a);
// out = in converted between fp32 and bf16 (same device, same element count)
void cast(const Tensor& out, const Tensor& in);

}  // namespace forge
