#pragma once

#include <cstdint>

namespace forge::cpu {

// logits and dlogits are [rows, vocab]; losses and targets are [rows]. Targets are either
// ignore_index or in [0, vocab) (validated by the caller). dlogits may be null (no
// gradient) or equal to logits (computed in place).
void cross_entropy_forward_backward(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                                    int64_t rows, int64_t vocab, int32_t ignore_index, float grad_scale);

}  // namespace forge::cpu
