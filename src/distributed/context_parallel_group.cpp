#include "distributed/context_parallel_group.h"

namespace forge {

void GroupContextParallel::rotate_start(const std::vector<Tensor>& received, const std::vector<Tensor>& sent) {
  ring_.start(received, sent);
}

void GroupContextParallel::rotate_wait() { ring_.wait(); }

}  // namespace forge
