// Token embedding on the GPU.
//
// Forward: a row copy, one thread per 8 columns with 16-byte loads and stores.
//
// Backward: dtable[tokens[n]] += dout[n] must be deterministic, so no atomics. The token
// ids (a few KB) are copied to the host and grouped there with a counting sort: for each
// distinct token, the positions holding it, in increasing order. The kernel then runs one
// block row per distinct token and one thread per column: the thread sums dout over that
// token's positions in order and adds the sum into the token's row of dtable once. Every
// row of dtable is written by exactly one block, the summation order is fixed, and the
// work is spread over (distinct tokens x columns) threads instead of walking all tokens
// per column. The host round trip costs a synchronization per call (one per micro-batch).
#include "kernels/cuda/embedding.h"

#include <vector>

#include "core/device.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int kColumnsPerBlock = 256;

__global__ void embedding_forward_kernel(bf16* out, const int32_t* tokens, const bf16* table, int64_t count,
                                         int64_t hidden) {
  int64_t chunks = hidden / 8;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count * chunks) return;
  int64_t n = i / chunks, c = (i % chunks) * 8;
  *reinterpret_cast<uint4*>(out + n * hidden + c) =
      *reinterpret_cast<const uint4*>(table + static_cast<int64_t>(tokens[n]) * hidden + c);
}

// index = [unique tokens (U) | segment starts (U + 1) | positions sorted by token (count)]
__global__ void embedding_backward_kernel(float* dtable, const bf16* dout, const int32_t* index, int64_t unique,
                                          int64_t hidden) {
  int64_t u = blockIdx.x;  // x: up to 2^31 - 1 distinct tokens; y: column blocks
  int64_t d = static_cast<int64_t>(blockIdx.y) * kColumnsPerBlock + threadIdx.x;
  if (d >= hidden) return;
  const int32_t* starts = index + unique;
  const int32_t* positions = index + 2 * unique + 1;
  float sum = 0.f;
  for (int32_t k = starts[u]; k < starts[u + 1]; ++k) sum += __bfloat162float(dout[positions[k] * hidden + d]);
  dtable[static_cast<int64_t>(index[u]) * hidden + d] += sum;
}

}  // namespace

void embedding_forward(bf16* out, const int32_t* tokens, const bf16* table, int64_t count, int64_t hidden) {
  FORGE_CHECK(hidden % 8 == 0, "embedding: hidden {} must be a multiple of 8 on CUDA", hidden);
  int64_t n = count * hidden / 8;
  if (n) embedding_forward_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(out, tokens, table, count, hidden);
  FORGE_CUDA_LAUNCH_CHECK();
}

void embedding_backward(float* dtable, const bf16* dout, const int32_t* tokens, int64_t count, int64_t hidden) {
  if (hidden == 0 || count == 0) return;
  std::vector<int32_t> ids(static_cast<size_t>(count));
  copy_bytes(ids.data(), Device::CPU, tokens, Device::CUDA, sizeof(int32_t) * ids.size());

  // Counting sort of positions by token id, over the ids that occur.
  int32_t max_id = 0;
  for (int32_t id : ids) max_id = std::max(max_id, id);
  std::vector<int32_t> counts(static_cast<size_t>(max_id) + 1, 0);
  for (int32_t id : ids) ++counts[id];
  std::vector<int32_t> unique, starts{0};
  for (int32_t id = 0; id <= max_id; ++id) {
    if (!counts[id]) continue;
    unique.push_back(id);
    starts.push_back(starts.back() + counts[id]);
  }
  std::vector<int32_t> next(static_cast<size_t>(max_id) + 1, 0);
  for (size_t u = 0; u < unique.size(); ++u) next[unique[u]] = starts[u];
  std::vector<int32_t> index;
  index.reserve(unique.size() * 2 + 1 + ids.size());
  index.insert(index.end(), unique.begin(), unique.end());
  index.insert(index.end(), starts.begin(), starts.end());
  std::vector<int32_t> positions(ids.size());
  for (int64_t n = 0; n < count; ++n) positions[next[ids[n]]++] = static_cast<int32_t>(n);
  index.insert(index.end(), positions.begin(), positions.end());

  int32_t* device_index =
      static_cast<int32_t*>(scratch_buffer(ScratchSlot::EmbeddingIndex, sizeof(int32_t) * index.size()));
  copy_bytes(device_index, Device::CUDA, index.data(), Device::CPU, sizeof(int32_t) * index.size());
  dim3 grid(static_cast<unsigned>(unique.size()),
            static_cast<unsigned>((hidden + kColumnsPerBlock - 1) / kColumnsPerBlock));
  embedding_backward_kernel<<<grid, kColumnsPerBlock>>>(dtable, dout, device_index,
                                                        static_cast<int64_t>(unique.size()), hidden);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
