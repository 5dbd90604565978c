// Where an op's tensors may live and in which dtype, shared by the op dispatchers.
//
// NOTE [Op placement]
// An op runs where its tensors are: all on the CPU or all on one GPU. On the CPU every
// floating-point tensor is fp32 (the reference). On CUDA activations and compute weights
// are bf16, while statistics (rstd, lse, losses), master weights, gradients of weights
// and optimizer state are fp32. Each dispatcher checks this and then calls forge::cpu::op
// or forge::cuda::op; a build without the CUDA backend fails clearly on CUDA tensors.
#pragma once

#include "core/tensor.h"

namespace forge {

void expect_tensor(const Tensor& t, Device device, DType dtype, const char* what);
[[noreturn]] void fail_without_cuda(const char* op);

}  // namespace forge

#ifdef FORGE_CUDA
#define FORGE_CUDA_CALL(op, ...) __VA_ARGS__
#else
#define FORGE_CUDA_CALL(op, ...) ::forge::fail_without_cuda(op)
#endif

#ifdef FORGE_CUDA
#include "kernels/cuda/types.h"

namespace forge {

// A bf16 tensor's elements as the CUDA kernels take them.
inline cuda::bf16* bf16_ptr(const Tensor& t) { return static_cast<cuda::bf16*>(t.raw()); }

}  // namespace forge
#endif
