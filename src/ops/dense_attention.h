// Attention computed as explicit scores, forward only, for the encoders that
// prepare FLUX's inputs: T5's self-attention (a relative position bias added to
// the scores, no 1/sqrt(d) scaling) and the VAE's mid-block attention (one head
// of 512, no bias).
//   s[b,h,i,j] = scale * q[b,i,h,:] . k[b,j,h,:] + bias[h,i,j]
//   out[b,i,h,:] = sum_j softmax_j(s[b,h,i,:]) v[b,j,h,:]
// q [B, Lq, H, D], k [B, Lk, H, D], v [B, Lk, H, Dv], out [B, Lq, H, Dv]:
// forge's token-major attention layout (a linear layer's output viewed per
// head), any head dims; bias [H, Lq, Lk], shared by every sample of the batch,
// or none. Every query sees every key (no mask, no causality). CPU fp32; CUDA
// bf16 tensors (the bias too) with the scores, the bias add and the softmax in
// fp32 (NOTE [Dense attention on the GPU] in kernels/cuda/dense_attention.cu).
//
// NOTE [Dense attention]
// forge's training attention (ops/attention.h, cuDNN's fused kernel) keeps no
// scores and takes no bias. An encoder run once per caption or image needs
// neither its speed nor a backward, but does need an additive bias and head
// dims cuDNN does not take (512), so this op writes the scores out: two batched
// GEMMs around a softmax. Its memory is bounded: on the GPU the (sample, head)
// pairs and query rows go through in chunks whose scores fit a fixed budget, so
// Lq x Lk per pair may be large (a 1024x1024 image's VAE attention is 16384 x
// 16384 per pair).
#pragma once

#include "core/tensor.h"

namespace forge {

// `bias`: null for none. Lk must be at least 1.
void dense_attention_forward(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* bias,
                             float scale);

}  // namespace forge
