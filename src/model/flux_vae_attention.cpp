// The VAE mid block's single-head attention; NOTE [VAE mid-block attention] in
// flux_vae_attention.h.
#include "model/flux_vae_attention.h"

#include <cmath>

#include "ops/attention.h"
#include "ops/dense_attention.h"

namespace forge {

void vae_attention(const Tensor& out, const Tensor& qkv, VaeActivationPool& pool) {
  FORGE_CHECK(qkv.ndim() == 4 && qkv.dim(2) == 3, "vae_attention: qkv {} must be [B, S, 3, C]",
              shape_str(qkv.shape()));
  const int64_t batch = qkv.dim(0), seq = qkv.dim(1), channels = qkv.dim(3);
  check_shape(out, {batch, seq, channels}, "vae_attention out");
  const float scale = 1.0f / std::sqrt(static_cast<float>(channels));
  if (qkv.device() == Device::CPU) {
    const AttentionShape shape{1, 1, 0, scale, channels, channels, false};
    VaeActivationPool::Lease lse = pool.take({batch, 1, seq});
    attention_forward(out.view({batch, seq, 1, channels}), *lse, qkv, shape);
    return;
  }
  const Tensor packed = qkv.view({batch * seq, 3 * channels});
  VaeActivationPool::Lease q = pool.take({batch, seq, channels}), k = pool.take({batch, seq, channels}),
                           v = pool.take({batch, seq, channels});
  copy_columns(q->view({batch * seq, channels}), 0, packed, 0, channels);
  copy_columns(k->view({batch * seq, channels}), 0, packed, channels, channels);
  copy_columns(v->view({batch * seq, channels}), 0, packed, 2 * channels, channels);
  const Shape heads{batch, seq, 1, channels};
  dense_attention_forward(out.view(heads), q->view(heads), k->view(heads), v->view(heads), nullptr, scale);
}

}  // namespace forge
