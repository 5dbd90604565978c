// Softmax along each row of a matrix, forward only:
//   probs[r, j] = exp(scores[r, j] - max_j scores[r, :]) / sum_j exp(scores[r, j] - max)
// The probabilities of attention computed with its scores materialized (the VAE mid-block's
// single head of 512 dims, model/flux_vae_attention.h). scores and probs [R, N]. CPU: fp32
// (sums in double). CUDA: scores fp32, probs bf16 (computed in fp32).
#pragma once

#include "core/tensor.h"

namespace forge {

void row_softmax(const Tensor& probs, const Tensor& scores);

}  // namespace forge
