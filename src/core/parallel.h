// A small persistent thread pool for the CPU reference kernels.
//
// NOTE [Deterministic CPU parallelism]
// parallel_for hands each index to exactly one thread and kernels never let two threads
// add into the same output element, so every result is computed in the same order no
// matter how many threads run. Same inputs, same bits: this is what makes CPU training
// runs reproducible and checkpoint resume bitwise exact.
#pragma once

#include <cstdint>
#include <functional>

namespace forge {

// Number of worker threads (FORGE_NUM_THREADS, else the hardware concurrency).
int num_threads();

// Calls fn(begin, end) over disjoint chunks that cover [0, n). Chunks are at least `grain`
// long so tiny loops stay on the calling thread.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace forge
