// Softmax cross-entropy on the GPU, fused with its gradient. Per row of bf16 logits x:
// lse = log(sum exp(x)), loss = lse - x[target], and when asked
// dlogits = scale * (exp(x - lse) - onehot(target)), in place or to a separate buffer.
// Everything is computed in fp32 from bf16 inputs. Out-of-range targets are the data
// layer's job to reject; ignored rows get loss 0 and zero gradient.
//
// Training goes through a thread block cluster, so that each row is read from HBM once.
// No gradient value can be written before the row's lse is known, so a kernel that streams
// the row reads it twice: 2 reads + 1 write. Keeping the row on chip between the two passes
// makes it 1 read + 1 write (Llama 3, 128256 logits x 8192 rows: 6.3 GB -> 4.2 GB a call,
// 2.15 -> 1.63 ms on an H100, where a plain 1-read-1-write elementwise kernel takes 1.49 ms
// and a device-to-device copy 1.39). A 128256-logit row is 256.5 kB, more than one SM's
// shared memory (227 KB per block), so the CTAs of a cluster (Hopper) split it: each copies
// its slice into its own shared memory with 16-byte cp.async and reduces it to a partial
// (max, sum of exp); the partials are exchanged through distributed shared memory, so every
// CTA merges the same lse; the CTA that holds the target writes the loss, and each CTA writes
// its slice's gradient from shared memory. A cluster has the fewest CTAs (1, 2, 4 or 8, all
// portable sizes) whose slices fit a third of an SM's shared memory, so three CTAs of 512
// threads share an SM and one's loads overlap another's arithmetic: 128256 logits take 4
// CTAs of 64.1 kB, 151936 take 4 of 76.0 kB, 32000 one CTA. Longer rows take 8 CTAs with
// bigger slices, up to the 227 KB a block may have. (Measured and not kept: 256 or 384
// threads, 8 CTAs of half the slice, loads in stages, and a persistent grid that prefetches
// its next row into a second buffer were all as fast or slower.) A CTA must not exit while
// another still reads its shared memory, so each ends at a cluster barrier. A row whose
// target is ignored is never read: its cluster writes zeros and exits without synchronizing.
//
// The streaming kernel serves everything else: only the loss wanted, rows whose length or
// addresses do not allow 16-byte accesses, rows too long for 8 CTAs' shared memory. One
// block per row; pass 1 reads the row once with an online softmax: each thread keeps a
// running max and a running sum of exp(x - max). It loads 8 bf16 logits (16 bytes) at a
// time, takes their max first and rescales its sum at most once per load, so the
// exponentials cost one per logit; the block then merges the (max, sum) pairs. Pass 2
// (training) re-reads the row and writes the gradient, 8 values per store. Rows whose length
// or address does not allow 16-byte accesses take a scalar path.
#include "kernels/cuda/cross_entropy.h"

#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>
#include <climits>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kVector = 8;  // bf16 values per 16-byte access

constexpr int kClusterThreads = 512;
constexpr int kMaxClusterCtas = 8;  // the largest portable cluster
constexpr int kCtasPerSm = 3;
// A slice's share of an SM: a third of Hopper's 228 KB, less the 1 KB the hardware keeps
// per block and the kernel's static shared memory.
constexpr int64_t kSliceBudget = 228 * 1024 / kCtasPerSm - 1024 - 512;

struct MaxSum {
  float max, sum;
};

__device__ MaxSum merge(MaxSum a, MaxSum b) {
  float m = fmaxf(a.max, b.max);
  if (m == -FLT_MAX) return {m, 0.f};
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

// Adds n values (already in fp32) to a thread's running (max, sum).
__device__ void accumulate(MaxSum& acc, const float* x, int n) {
  float m = acc.max;
  for (int i = 0; i < n; ++i) m = fmaxf(m, x[i]);
  if (m > acc.max) {
    acc.sum = acc.max == -FLT_MAX ? 0.f : acc.sum * __expf(acc.max - m);
    acc.max = m;
  }
  for (int i = 0; i < n; ++i) acc.sum += __expf(x[i] - m);
}

__device__ MaxSum warp_merge(MaxSum acc) {
  for (int o = 16; o > 0; o >>= 1)
    acc = merge(acc, MaxSum{__shfl_xor_sync(0xffffffffu, acc.max, o), __shfl_xor_sync(0xffffffffu, acc.sum, o)});
  return acc;
}

__device__ void load8(float (&out)[kVector], const bf16* p) { unpack8(*reinterpret_cast<const uint4*>(p), out); }

__device__ void store8(bf16* p, const float (&in)[kVector]) { *reinterpret_cast<uint4*>(p) = pack8(in); }

// 16 bytes from global to shared memory without passing through registers (LDGSTS).
__device__ void copy16_async(uint4* shared, const uint4* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(shared))),
               "l"(global)
               : "memory");
}

// Waits for this thread's cp.async copies; they are then visible to this thread.
__device__ void wait_async_copies() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__global__ void cross_entropy_kernel(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                     int64_t vocab, int32_t ignore_index, float grad_scale) {
  __shared__ MaxSum shared[kThreads / 32];
  __shared__ float shared_lse;
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * vocab;
  bf16* dx = dlogits ? dlogits + row * vocab : nullptr;
  const int32_t target = targets[row];
  const bool ignored = target == ignore_index;
  const bool vectorized = vocab % kVector == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                          (!dx || reinterpret_cast<uintptr_t>(dx) % 16 == 0);

  MaxSum acc{-FLT_MAX, 0.f};
  if (vectorized) {
    for (int64_t v = threadIdx.x * kVector; v < vocab; v += kThreads * kVector) {
      float values[kVector];
      load8(values, x + v);
      accumulate(acc, values, kVector);
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
      float value = __bfloat162float(x[v]);
      accumulate(acc, &value, 1);
    }
  }
  acc = warp_merge(acc);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum total = shared[0];
    for (int w = 1; w < kThreads / 32; ++w) total = merge(total, shared[w]);
    float lse = logf(total.sum) + total.max;
    shared_lse = lse;
    losses[row] = ignored ? 0.f : lse - __bfloat162float(x[target]);
  }
  __syncthreads();
  if (!dx) return;
  const float lse = shared_lse;
  const float scale = ignored ? 0.f : grad_scale;
  if (vectorized) {
    for (int64_t v = threadIdx.x * kVector; v < vocab; v += kThreads * kVector) {
      float values[kVector];
      load8(values, x + v);
#pragma unroll
      for (int i = 0; i < kVector; ++i)
        values[i] = scale * (__expf(values[i] - lse) - (v + i == target ? 1.f : 0.f));
      store8(dx + v, values);
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads)
      dx[v] = __float2bfloat16(scale * (__expf(__bfloat162float(x[v]) - lse) - (v == target ? 1.f : 0.f)));
  }
}

// One cluster per row, the row split into slices of slice_vectors 16-byte vectors (the last
// CTAs' slices may be shorter or empty), one slice per CTA in dynamic shared memory. Each
// thread copies, reduces and differentiates the same vectors of its slice, so it reads only
// what its own cp.async wrote. Every branch before a cluster barrier is uniform over the
// cluster (the row's target), so all of a cluster's CTAs reach each barrier.
__global__ void __launch_bounds__(kClusterThreads, kCtasPerSm)
    cross_entropy_cluster_kernel(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                 int64_t vocab, int slice_vectors, int32_t ignore_index, float grad_scale) {
  extern __shared__ uint4 slice[];
  __shared__ MaxSum warp_partials[kClusterThreads / 32];
  __shared__ MaxSum slice_partial;
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int ctas = static_cast<int>(cluster.num_blocks());
  const int64_t row = blockIdx.x / ctas;
  const int64_t first = static_cast<int64_t>(rank) * slice_vectors;  // the slice's first vector in the row
  const int count = static_cast<int>(max(int64_t{0}, min(int64_t{slice_vectors}, vocab / kVector - first)));
  const uint4* x = reinterpret_cast<const uint4*>(logits + row * vocab) + first;
  uint4* dx = reinterpret_cast<uint4*>(dlogits + row * vocab) + first;
  const int32_t target = targets[row];

  if (target == ignore_index) {
    for (int i = threadIdx.x; i < count; i += kClusterThreads) dx[i] = make_uint4(0, 0, 0, 0);
    if (rank == 0 && threadIdx.x == 0) losses[row] = 0.f;
    return;
  }

  for (int i = threadIdx.x; i < count; i += kClusterThreads) copy16_async(slice + i, x + i);
  wait_async_copies();
  MaxSum acc{-FLT_MAX, 0.f};
  for (int i = threadIdx.x; i < count; i += kClusterThreads) {
    float values[kVector];
    unpack8(slice[i], values);
    accumulate(acc, values, kVector);
  }
  acc = warp_merge(acc);
  if (threadIdx.x % 32 == 0) warp_partials[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum total = warp_partials[0];
    for (int w = 1; w < kClusterThreads / 32; ++w) total = merge(total, warp_partials[w]);
    slice_partial = total;
  }
  // Every CTA's slice is loaded and its partial written. From here on a CTA writes only its
  // own slice of dlogits, so writing in place cannot clobber logits another CTA still reads.
  cluster.sync();
  MaxSum total{-FLT_MAX, 0.f};
  for (int r = 0; r < ctas; ++r) total = merge(total, *cluster.map_shared_rank(&slice_partial, r));
  cg::cluster_group::arrival_token done_reading = cluster.barrier_arrive();
  const float lse = logf(total.sum) + total.max;
  const int64_t target_offset = target - first * kVector;  // the target's position in this slice
  if (threadIdx.x == 0 && target_offset >= 0 && target_offset < int64_t{count} * kVector)
    losses[row] = lse - __bfloat162float(reinterpret_cast<const bf16*>(slice)[target_offset]);
  for (int i = threadIdx.x; i < count; i += kClusterThreads) {
    float values[kVector];
    unpack8(slice[i], values);
    const int64_t offset = int64_t{i} * kVector;
#pragma unroll
    for (int k = 0; k < kVector; ++k)
      values[k] = grad_scale * (__expf(values[k] - lse) - (offset + k == target_offset ? 1.f : 0.f));
    dx[i] = pack8(values);
  }
  // No CTA exits while another may still read its slice_partial.
  cluster.barrier_wait(std::move(done_reading));
}

// The largest slice, in bytes, the cluster kernel may hold on the current device (0 where
// the device cannot launch clusters). Raises the kernel's dynamic shared memory limit to it
// once per thread and device.
int64_t max_slice_bytes() {
  thread_local int cached_device = -1;
  thread_local int64_t cached_bytes = 0;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (device == cached_device) return cached_bytes;
  int cluster_launch = 0, optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes{};
  CUDA_CHECK(cudaFuncGetAttributes(&attributes, cross_entropy_cluster_kernel));
  int64_t bytes = cluster_launch ? optin - static_cast<int64_t>(attributes.sharedSizeBytes) : 0;
  if (bytes > 0) {
    CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_cluster_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)));
    CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_cluster_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared));
  }
  cached_device = device;
  cached_bytes = std::max<int64_t>(bytes, 0);
  return cached_bytes;
}

// CTAs per cluster for a row of `vectors` 16-byte vectors: the fewest whose slices fit
// kSliceBudget, else 8 if theirs fit the device at all; 0 if not even that.
int cluster_ctas(int64_t vectors, int64_t max_bytes) {
  const int64_t budget = std::min(kSliceBudget, max_bytes);
  for (int ctas = 1; ctas <= kMaxClusterCtas; ctas *= 2)
    if ((vectors + ctas - 1) / ctas * 16 <= budget) return ctas;
  return (vectors + kMaxClusterCtas - 1) / kMaxClusterCtas * 16 <= max_bytes ? kMaxClusterCtas : 0;
}

}  // namespace

void cross_entropy_forward_backward(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                    int64_t rows, int64_t vocab, int32_t ignore_index, float grad_scale) {
  if (!rows) return;
  const bool vectorized = vocab % kVector == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(dlogits) % 16 == 0;
  const int ctas = dlogits && vectorized ? cluster_ctas(vocab / kVector, max_slice_bytes()) : 0;
  if (ctas && rows <= INT_MAX / ctas) {
    const int64_t vectors = vocab / kVector;
    const int slice_vectors = static_cast<int>((vectors + ctas - 1) / ctas);
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(ctas);
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(rows * ctas));
    config.blockDim = dim3(kClusterThreads);
    config.dynamicSmemBytes = static_cast<size_t>(slice_vectors) * 16;
    config.stream = nullptr;
    config.attrs = &cluster;
    config.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&config, cross_entropy_cluster_kernel, losses, dlogits, logits, targets, vocab,
                                  slice_vectors, ignore_index, grad_scale));
  } else {
    cross_entropy_kernel<<<static_cast<unsigned>(rows), kThreads>>>(losses, dlogits, logits, targets, vocab,
                                                                   ignore_index, grad_scale);
  }
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
