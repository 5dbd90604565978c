// A rank's share of the routed experts' stacks under expert parallelism, as a parameter
// spec: what a holder of the local experts alone (QLoRA's NF4 base, NOTE [NF4 expert stacks
// under expert parallelism] in model/nf4_base.h) and the memory estimate size by.
#pragma once

#include <cstdint>
#include <vector>

#include "model/parameters.h"

namespace forge {

// A rank's place among the ranks that split the routed experts (NOTE [Expert parallelism]
// in model/expert_dispatch.h): rank `index` of `size` holds experts [index E/size,
// (index + 1) E/size) of every stack; {0, 1}: all of them.
struct ExpertShard {
  int64_t index = 0, size = 1;
};

// An expert stack's slice that `shard` holds: the same name, [E/size, R, C], and its
// experts' Hugging Face tensors; any other parameter unchanged. Fails naming the parameter
// when size does not divide the experts.
ParamSpec expert_parallel_spec(const ParamSpec& whole, ExpertShard shard);
std::vector<ParamSpec> expert_parallel_specs(std::vector<ParamSpec> specs, ExpertShard shard);

}  // namespace forge
