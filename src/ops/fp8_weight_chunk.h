// FSDP's FP8 all-gather, the ops side (NOTE [FP8 all-gather] in distributed/fsdp.h): a rank
// casts its own fp32 master chunk of an FP8 weight to E4M3 codes with the whole weight's
// scale, so that 1 byte per element travels, and the gathered codes are transposed for the
// input gradient. The codes are bitwise those the bf16-gather path casts from the gathered
// compute weight: the values go through the compute dtype first (bf16 on CUDA; the CPU
// reference computes in fp32, so there they are the fp32 values themselves).
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace forge {

// amax [1] (F32, on chunk's device) = max |compute(chunk)| over the fp32 chunk (NaN if one
// is NaN, 0 when empty); written over.
void fp8_chunk_amax(const Tensor& amax, const Tensor& chunk, CudaStream stream = nullptr);
// For each k < amax.numel(): scales[2 k stride] = torchao's amax_to_scale(amax[k]) for E4M3
// and scales[(2 k + 1) stride] = 1 / it, exactly as the FP8 linear ops compute a current
// scale (stride = kFp8StatStride: each value at its own 256-byte boundary, as cuBLASLt wants).
void fp8_chunk_scales(const Tensor& scales, const Tensor& amax, CudaStream stream = nullptr);
// codes (U8, chunk's size) = E4M3 cast_saturated(compute(chunk) * scale[0]); with `amax`
// ([1] F32, or undefined), max |compute(chunk)| is folded into it (NaN winning).
void fp8_chunk_cast(const Tensor& codes, const Tensor& chunk, const Tensor& scale, const Tensor& amax,
                    CudaStream stream = nullptr);
// out [cols, rows] = in [rows, cols] transposed, bytes (U8), on either device.
void fp8_transpose_codes(const Tensor& out, const Tensor& in, CudaStream stream = nullptr);

}  // namespace forge
