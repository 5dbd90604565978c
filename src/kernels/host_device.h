// FORGE_HOST_DEVICE marks a function that CUDA kernels and host code both call (the same
// arithmetic on both sides): __host__ __device__ under nvcc, nothing elsewhere.
#pragma once

#ifdef __CUDACC__
#define FORGE_HOST_DEVICE __host__ __device__
#else
#define FORGE_HOST_DEVICE
#endif
