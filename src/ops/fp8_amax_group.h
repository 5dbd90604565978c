// The ranks over which an FP8 projection's current-scaling amaxes are max-reduced before a
// scale is computed from them (NOTE [FP8 under tensor parallelism] in
// model/fp8_projections.h): every rank of a tensor-parallel group then quantizes a tensor
// sharded over the group with the scale the whole tensor would get. The tensor-parallel
// interface the decoder is handed is one (model/tensor_parallel.h), implemented over a
// process group by the distributed layer; ops/ and model/ call no collective of their own.
#pragma once

#include "core/tensor.h"

namespace forge {

class Fp8AmaxGroup {
 public:
  virtual ~Fp8AmaxGroup() = default;
  // In place: the elementwise maximum over the group's ranks (fp32, on the tensor's device).
  virtual void all_reduce_max(const Tensor& tensor) = 0;
};

}  // namespace forge
