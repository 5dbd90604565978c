// QLoRA's frozen NF4 base under precision.fp8 on CUDA: a projection's E4M3 codes made
// straight from its NF4 codes, for the FP8 GEMMs to take as gathered codes.
//
// NOTE [FP8 straight from NF4]
// NOTE [FP8 over an NF4 base] (model/nf4_base.cpp) runs each base GEMM as QLoRA does, the
// codes dequantized into the shared bf16 scratch, and the FP8 op then takes an amax pass and
// a cast pass over that bf16 copy: 0.5 + 2 + 2 + 2 + 1 = 7.5 bytes of traffic per weight
// before the forward GEMM. Here the kernels (kernels/cuda/nf4_fp8.cu) make each weight's
// bf16 value in registers exactly as the dequantization would and treat it exactly as the
// FP8 op's amax and cast would: an amax pass over the NF4 codes (0.5 byte per weight;
// tensorwise only, the parts of a fused projection folded into one amax, max-reduced over
// W's amax group under tensor parallelism) and the scales from it by the same function
// (fp8_chunk_scales), then the cast (0.5 read, 1 written) into the scratch's first bytes,
// viewed as U8 [out, in]. `delayed` casts with W's scale in the projection's statistics
// block and folds the amax in the same pass. The FP8 op then takes those codes as an FSDP
// gather's (NOTE [FP8 gathered weights] in ops/fp8_linear.h): no cast of W in the forward,
// W^T as the codes' byte transpose in the input gradient, the amax folded into W's `seen`
// where a cast would have folded it. The codes, scales and amaxes are the unfused path's,
// so every result is bitwise the same (GpuNf4Fp8.*). It needs the workspace's nf4_stats
// (Fp8Projections makes them); a weight with a stored row order (NOTE [NF4 stored row
// order]) or on the CPU takes the unfused path, which stays the reference.
#pragma once

#include "ops/fp8_linear.h"
#include "ops/linear.h"

namespace forge {

// Whether w (an NF4 weight with FP8 settings) takes the path above.
bool nf4_fp8_straight(const LinearWeight& w);

// W's E4M3 codes cast from w.nf4 into the U8 view of w.weight, returned with how they were
// cast (pointers into the workspace's nf4_stats, valid until the next call).
struct Nf4Fp8Codes {
  Tensor codes;  // U8 [out, in]
  Fp8GatheredWeight cast;
};
Nf4Fp8Codes nf4_fp8_codes(const LinearWeight& w);

}  // namespace forge
