// Token embedding on the GPU.
//
// Forward: a row copy, one thread per 8 columns with 16-byte loads and stores.
//
// Backward: dtable[tokens[n]] += dout[n], deterministic, so no float atomics. The
// positions are grouped by token on the GPU: CUB's radix sort orders the pairs (token id,
// position) by id, and an LSD radix sort is stable, so each token's positions stay in
// increasing order. One thread per (sorted index, 8 columns): a thread at the start of a
// token's run sums that token's dout rows in position order in fp32, 8 loads in flight,
// and adds the sum into the token's row of dtable once; the other threads exit. Each
// element of dtable has one writer and a summation order set by the tokens alone, so
// every run gives the same bits. Nothing comes back to the host: the call only queues
// work on the stream, without the synchronization a host-side grouping costs.
// Bytes for 8192 distinct tokens x 4096: read dout 67 MB, read and write dtable rows
// 134 MB each: 335 MB, 0.11 ms at 3.0 TB/s; the sort moves 8192 x 8 bytes per pass. A
// token's run is summed by hidden / 8 threads only, so a very long one (padding, say)
// takes time in proportion to its length.
//
// A table may be one shard of the vocabulary, rows [vocab_begin, vocab_begin + rows)
// (NOTE [Vocabulary-parallel embedding]): the forward writes zeros for the ids it does not
// hold, the backward sorts every id and adds only the runs of the ids it holds. A whole
// table is the shard that starts at 0.
//
// Assumes hidden is a multiple of 8 and the ids in [0, vocab_size) (checked where the batch
// is made), so they sort as unsigned 32-bit keys.
#include "kernels/cuda/embedding.h"

#include <climits>
#include <cub/cub.cuh>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 8;

__global__ void embedding_forward_kernel(bf16* out, const int32_t* tokens, const bf16* table, int64_t count,
                                         int64_t vocab_begin, int64_t rows, int64_t hidden) {
  int64_t chunks = hidden / 8;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count * chunks) return;
  int64_t n = i / chunks, c = (i % chunks) * 8;
  int64_t row = tokens[n] - vocab_begin;
  *reinterpret_cast<uint4*>(out + n * hidden + c) =
      row >= 0 && row < rows ? *reinterpret_cast<const uint4*>(table + row * hidden + c) : make_uint4(0, 0, 0, 0);
}

__global__ void iota_kernel(int32_t* out, int64_t count) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = static_cast<int32_t>(i);
}

// ids: the token ids sorted; positions: each one's row of dout, increasing within a token.
// dtable holds the ids [vocab_begin, vocab_begin + rows); the runs of other ids are skipped.
__global__ void embedding_backward_kernel(float* dtable, const bf16* __restrict__ dout,
                                          const uint32_t* __restrict__ ids, const int32_t* __restrict__ positions,
                                          int64_t count, int64_t vocab_begin, int64_t rows, int64_t hidden) {
  int64_t chunks = hidden / 8;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count * chunks) return;
  int64_t start = i / chunks, c = (i % chunks) * 8;
  uint32_t id = ids[start];
  const int64_t row_index = static_cast<int64_t>(id) - vocab_begin;
  if (row_index < 0 || row_index >= rows) return;  // not this table's id
  if (start > 0 && ids[start - 1] == id) return;  // not the first index of its token's run
  int64_t end = start + 1;
  while (end < count && ids[end] == id) ++end;

  float4* row = reinterpret_cast<float4*>(dtable + row_index * hidden + c);
  float4 lo = row[0], hi = row[1];  // this thread alone writes these columns of the row

  // The rows are summed in position order, kLoadsInFlight at a time: all of a group's loads
  // are issued before its first add, so a long run waits on memory once per group.
  float sum[8] = {};
  for (int64_t k = start; k < end; k += kLoadsInFlight) {
    uint4 raw[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u)
      if (k + u < end) raw[u] = *reinterpret_cast<const uint4*>(dout + positions[k + u] * hidden + c);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (k + u >= end) break;
      float v[8];
      unpack8(raw[u], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum[e] += v[e];
    }
  }
  row[0] = make_float4(lo.x + sum[0], lo.y + sum[1], lo.z + sum[2], lo.w + sum[3]);
  row[1] = make_float4(hi.x + sum[4], hi.y + sum[5], hi.z + sum[6], hi.w + sum[7]);
}

unsigned blocks_for(int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

void embedding_forward(bf16* out, const int32_t* tokens, const bf16* table, int64_t count, int64_t vocab_begin,
                       int64_t rows, int64_t hidden) {
  FORGE_CHECK(hidden % 8 == 0, "embedding: hidden {} must be a multiple of 8 on CUDA", hidden);
  int64_t n = count * hidden / 8;
  if (n) embedding_forward_kernel<<<blocks_for(n), kThreads>>>(out, tokens, table, count, vocab_begin, rows, hidden);
  FORGE_CUDA_LAUNCH_CHECK();
}

void embedding_backward(float* dtable, const bf16* dout, const int32_t* tokens, int64_t count, int64_t vocab_begin,
                        int64_t rows, int64_t hidden) {
  FORGE_CHECK(hidden % 8 == 0, "embedding_backward: hidden {} must be a multiple of 8 on CUDA", hidden);
  FORGE_CHECK(count <= INT_MAX, "embedding_backward: {} tokens do not fit int32 positions", count);
  if (hidden == 0 || count == 0) return;

  // Scratch, each part 256-byte aligned: sorted ids | positions | sorted positions | CUB's.
  const uint32_t* ids = reinterpret_cast<const uint32_t*>(tokens);  // ids >= 0 sort the same unsigned
  size_t cub_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, ids, static_cast<uint32_t*>(nullptr),
                                             static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                             static_cast<int>(count)));
  size_t part = aligned(sizeof(int32_t) * count);
  char* scratch = static_cast<char*>(scratch_buffer(ScratchSlot::EmbeddingIndex, 3 * part + cub_bytes));
  uint32_t* sorted_ids = reinterpret_cast<uint32_t*>(scratch);
  int32_t* positions = reinterpret_cast<int32_t*>(scratch + part);
  int32_t* sorted_positions = reinterpret_cast<int32_t*>(scratch + 2 * part);

  iota_kernel<<<blocks_for(count), kThreads>>>(positions, count);
  FORGE_CUDA_LAUNCH_CHECK();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch + 3 * part, cub_bytes, ids, sorted_ids, positions,
                                             sorted_positions, static_cast<int>(count)));
  int64_t n = count * hidden / 8;
  embedding_backward_kernel<<<blocks_for(n), kThreads>>>(dtable, dout, sorted_ids, sorted_positions, count,
                                                         vocab_begin, rows, hidden);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
