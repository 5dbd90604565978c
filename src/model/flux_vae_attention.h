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
//  - CUDA: cuDNN's fused attention takes head dims up to 256, so q, k and v are copied out
//    of qkv (copy_columns) and go through the dense attention op (NOTE [Dense attention] in
//    ops/dense_attention.h: explicit fp32 scores in chunks of bounded memory, no bias).
#pragma once

#include "core/tensor.h"
#include "model/flux_vae_activations.h"

namespace forge {

// out [B, S, C], qkv [B, S, 3, C], both on one device (fp32 CPU, bf16 CUDA). `pool` lends the
// temporaries in the activations' dtype.
void vae_attention(const Tensor& out, const Tensor& qkv, VaeActivationPool& pool);

}  // namespace forge
