// The self-attention of the VAE's mid blocks (NOTE [VAE mid-block attention]).
//
// NOTE [VAE mid-block attention]
// diffusers builds the mid block's Attention with one head whose dim is the channel count
// (512 for FLUX), no mask, scale 1 / sqrt(C): every pixel of an image attends to every
// pixel of the same image, (H/8)(W/8) tokens at FLUX's 8x downsampling (16384 at
// 1024x1024). q, k and v come packed from one fused projection (NOTE [FLUX VAE parameters]):
// qkv [B, S, 3, C], the attention op's layout (ops/attention.h) with one head.
// vae_attention computes out [B, S, C] = softmax(q k^T / sqrt(C)) v per image:
//  - CPU: the attention op (bidirectional, one query and one key/value head of dim C;
//    kernels/cpu/attention.cpp takes any head dim).
//  - CUDA: cuDNN's fused attention takes head dims up to 256, so the scores are
//    materialized, one image at a time: q, k and v copied out of qkv (copy_columns), scores
//    [S, S] = q k^T / sqrt(C) in fp32 (matmul_batched), row_softmax to bf16 probabilities,
//    out = probs v (matmul_batched). An image's scores take 4 S^2 bytes (1 GiB at 1024x1024),
//    its probabilities 2 S^2. A stand-in until forge has a dense attention op of its own
//    for head dims cuDNN does not take; the GPU tests check it against the CPU path.
#pragma once

#include "core/tensor.h"
#include "model/flux_vae_activations.h"

namespace forge {

// out [B, S, C], qkv [B, S, 3, C], both on one device (fp32 CPU, bf16 CUDA). `pool` lends the
// temporaries in the activations' dtype, `scores_pool` the fp32 scores (CUDA only).
void vae_attention(const Tensor& out, const Tensor& qkv, VaeActivationPool& pool, VaeActivationPool& scores_pool);

}  // namespace forge
