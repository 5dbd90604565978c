#pragma once

#include "core/tensor.h"

namespace forge::cpu {

double sum_of_squares(const Tensor& a);

}  // namespace forge::cpu
