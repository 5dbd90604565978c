// The whole model's parameters from the shards of a tensor-parallel group (NOTE
// [Tensor-parallel shards] in model/parameters.h): what the Hugging Face export of a
// tensor-parallel run writes, as Fsdp::gather_to_host is for FSDP's chunks.
#pragma once

#include <span>

#include "core/device.h"
#include "distributed/process_group.h"
#include "model/config.h"

namespace forge {

// Every rank of `group` (tensor-parallel rank r of its size T) passes its shards' fp32
// values, host memory, parameter_specs(config, {r, T}) one after the other; rank 0 of the
// group gets the whole model's flat vector (parameter_specs(config) order) in `whole`
// (that many floats), each shard's values put where tensor_parallel_runs says (a
// replicated parameter's from rank 0). The shards travel by all-gathers on `device` (the
// group's) of slices of at most 16M values per rank, so the device holds T slices at a
// time and the host the model once more on rank 0. Every rank of the world calls it at
// once, each with its own group (as the CPU process group needs): a group whose result
// nobody keeps passes an empty `whole`, and its ranks may pass an empty `local` (they take
// part with zeros).
void gather_tensor_parallel_shards(ProcessGroup& group, Device device, const ModelConfig& config,
                                   std::span<const float> local, std::span<float> whole);

}  // namespace forge
