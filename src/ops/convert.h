// Tensors between the host's fp32 and the encoders' or models' compute dtype on their
// device: the one way the FLUX tools (forge prep --images, forge sample, their encoders,
// decoder and denoiser) move features in and out of a model (NOTE [Op placement]).
#pragma once

#include "core/tensor.h"

namespace forge {

// dst = src converted between fp32 and bf16 (or copied when the dtypes are equal), the two
// on any devices (same element count): fp32 host values into a compute tensor on the GPU
// (uploaded, then cast there) or back (cast on the GPU, then downloaded); ordered on the
// default stream.
void copy_converted(const Tensor& dst, const Tensor& src);

// `t` itself when it is `dtype` on `device` already, else a new tensor of its values there
// (copy_converted).
Tensor converted(const Tensor& t, Device device, DType dtype);

}  // namespace forge
