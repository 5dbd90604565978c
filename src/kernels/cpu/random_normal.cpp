// Standard normals on the CPU: the reference the CUDA kernel is held to. Each Philox block
// gives four consecutive numbers of the stream (NOTE [Counter-based normals] in
// kernels/philox.h); a thread's chunk of `out` computes each block it touches once, so
// the split between threads changes nothing.
#include "kernels/cpu/random_normal.h"

#include <limits>

#include "core/parallel.h"
#include "kernels/philox.h"

namespace forge::cpu {

void random_normal(float* out, int64_t n, uint64_t seed, uint64_t offset) {
  parallel_for(n, 4096, [&](int64_t begin, int64_t end) {
    float z[4];
    uint64_t block = std::numeric_limits<uint64_t>::max();  // none yet: k / 4 is always below it
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t k = offset + static_cast<uint64_t>(i);
      if (k / 4 != block) {
        block = k / 4;
        philox::normal4(seed, block, z);
      }
      out[i] = z[k % 4];
    }
  });
}

}  // namespace forge::cpu
