// Whole-tensor helpers: the sum of squares behind the global grad norm, fp32 <-> bf16
// casts (NOTE [Op placement]), and the accumulation of reduced gradient shards (FSDP) and of
// partial gradients.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace forge {

// sum of squares of all elements, accumulated in double (for the global grad norm)
double sum_of_squares(const Tensor& a);
// out = in converted between fp32 and bf16, or copied when the dtypes are equal (same
// device, same element count), enqueued
// on `stream` (CUDA; the CPU runs it at once).
void cast(const Tensor& out, const Tensor& in, CudaStream stream = nullptr);
// dst += src elementwise: dst fp32 and src fp32 or bf16, or both bf16 (the sum in fp32,
// rounded once); same device, same element count; enqueued on `stream` (CUDA; the CPU runs
// it at once).
void accumulate(const Tensor& dst, const Tensor& src, CudaStream stream = nullptr);

}  // namespace forge
