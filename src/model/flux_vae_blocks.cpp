// The FLUX VAE's layers (NOTE [FLUX VAE architecture] in flux_vae_config.h), each reading an
// NHWC activation and returning a new one from the activation pool.
#include <string>

#include "model/flux_vae.h"
#include "model/flux_vae_attention.h"
#include "ops/elementwise.h"
#include "ops/group_norm.h"
#include "ops/linear.h"
#include "ops/upsample.h"

namespace forge {

FluxVae::Lease FluxVae::conv(const std::string& prefix, const Tensor& x, const Conv2dShape& shape) {
  const Tensor& weight = params_.get(prefix + ".weight");
  Lease out = pool_.take(conv2d_out_shape(x.shape(), weight.dim(0), shape));
  conv2d_forward(*out, x, weight, params_.get(prefix + ".bias"), shape);
  return out;
}

FluxVae::Lease FluxVae::norm(const std::string& prefix, const Tensor& x, bool silu) {
  Lease out = pool_.take(x.shape());
  group_norm_forward(*out, x, params_.get(prefix + ".weight"), params_.get(prefix + ".bias"),
                     {config().norm_num_groups, config().norm_eps, silu});
  return out;
}

// x + conv2(SiLU(GN2(conv1(SiLU(GN1(x)))))), x through conv_shortcut (1x1) when the block
// changes the channel count (diffusers' ResnetBlock2D without a time embedding).
FluxVae::Lease FluxVae::resnet(const std::string& prefix, const Tensor& x) {
  Lease h = norm(prefix + ".norm1", x, true);
  Lease a = conv(prefix + ".conv1", *h, Conv2dShape::same(3));
  h = Lease();
  group_norm_forward(*a, *a, params_.get(prefix + ".norm2.weight"), params_.get(prefix + ".norm2.bias"),
                     {config().norm_num_groups, config().norm_eps, true});
  Lease out = conv(prefix + ".conv2", *a, Conv2dShape::same(3));
  a = Lease();
  if (x.dim(3) == out->dim(3)) {
    accumulate(*out, x);
    return out;
  }
  Lease shortcut = conv(prefix + ".conv_shortcut", x, Conv2dShape::same(1));
  accumulate(*out, *shortcut);
  return out;
}

// x + to_out(attention(to_qkv(GN(x)))) over the pixels of each image (NOTE [VAE mid-block
// attention]), diffusers' Attention with residual_connection and a group norm.
FluxVae::Lease FluxVae::attention(const std::string& prefix, const Tensor& x) {
  const int64_t batch = x.dim(0), seq = x.dim(1) * x.dim(2), channels = x.dim(3);
  Lease h = norm(prefix + ".group_norm", x, false);
  Lease qkv = pool_.take({batch, seq, 3, channels});
  LinearWeight to_qkv;
  to_qkv.weight = params_.get(prefix + ".to_qkv.weight");
  to_qkv.bias = params_.get(prefix + ".to_qkv.bias");
  linear_forward(qkv->view({batch * seq, 3 * channels}), h->view({batch * seq, channels}), to_qkv);
  h = Lease();
  Lease attended = pool_.take({batch, seq, channels});
  vae_attention(*attended, *qkv, pool_);
  qkv = Lease();
  Lease out = pool_.take(x.shape());
  LinearWeight to_out;
  to_out.weight = params_.get(prefix + ".to_out.0.weight");
  to_out.bias = params_.get(prefix + ".to_out.0.bias");
  const Tensor residual = x.view({batch * seq, channels});
  linear_forward(out->view({batch * seq, channels}), attended->view({batch * seq, channels}), to_out, &residual);
  return out;
}

// ResNet, attention (when the config has it), ResNet: diffusers' UNetMidBlock2D.
FluxVae::Lease FluxVae::mid_block(const std::string& prefix, const Tensor& x) {
  Lease h = resnet(prefix + ".resnets.0", x);
  if (config().mid_block_add_attention) h = attention(prefix + ".attentions.0", *h);
  return resnet(prefix + ".resnets.1", *h);
}

// Nearest 2x, then a 3x3 convolution: diffusers' Upsample2D with use_conv.
FluxVae::Lease FluxVae::upsample(const std::string& prefix, const Tensor& x) {
  Lease up = pool_.take({x.dim(0), 2 * x.dim(1), 2 * x.dim(2), x.dim(3)});
  upsample_nearest2x(*up, x);
  return conv(prefix + ".conv", *up, Conv2dShape::same(3));
}

}  // namespace forge
