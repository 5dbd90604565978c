#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// logits bf16 [rows, vocab]; targets int32 [rows] (ignore_index or in [0, vocab)); losses
// fp32 [rows]. dlogits (bf16, may be null or equal to logits) receives
// grad_scale * (softmax - onehot), zero on ignored rows.
void cross_entropy_forward_backward(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                    int64_t rows, int64_t vocab, int32_t ignore_index, float grad_scale);

}  // namespace forge::cuda
