// Softmax cross-entropy over logits [N, V] with int32 targets [N].
//   losses[n] = logsumexp(logits[n]) - logits[n, targets[n]], or 0 where the target is
//               ignore_index (masked positions).
// When dlogits is defined it receives the gradient of  grad_scale * sum_n losses[n]:
//   dlogits[n, :] = grad_scale * (softmax(logits[n]) - onehot(targets[n])), 0 on ignored rows.
// dlogits may alias logits: the output-projection chunk loop computes loss and gradient
// in one pass so full logits never need to be kept (NOTE [Chunked output head]).
// Targets outside [0, V) that are not ignore_index are an error.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

// The target id that marks a position without a target (PyTorch's default ignore_index).
constexpr int32_t kIgnoreIndex = -100;

void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, int32_t ignore_index, float grad_scale);

}  // namespace forge
