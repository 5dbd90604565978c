#pragma once

#include "core/tensor.h"

namespace forge::cpu {

void add_inplace(const Tensor& a, const Tensor& b);
void add(const Tensor& out, const Tensor& a, const Tensor& b);
void scale_inplace(const Tensor& a, float s);
double sum_of_squares(const Tensor& a);

}  // namespace forge::cpu
