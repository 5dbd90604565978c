// CLIP's text encoder (transformers' CLIPTextModel), forward only, for the pooled text vector
// FLUX.1 is conditioned on.
//
// NOTE [CLIP text encoder]
// FLUX.1 conditions every block on a pooled text vector: the pooler_output of OpenAI's CLIP
// ViT-L/14 text tower (diffusers' FluxPipeline._get_clip_prompt_embeds: the caption
// tokenized by CLIPTokenizer to exactly 77 tokens, padding="max_length", truncation, then
// text_encoder(ids) without an attention mask). The tower is a pre-norm transformer with
// causal self-attention:
//   h = token_embedding[ids] + position_embedding[0 .. T)
//   per layer: h += out_proj(attention(layer_norm1(h)))          causal, heads of D / H,
//              h += fc2(act(fc1(layer_norm2(h))))                scale 1 / sqrt(D / H)
//   last_hidden_state = final_layer_norm(h)                      [B, T, D]
//   pooler_output     = last_hidden_state[b, pooled position]    [B, D] (NOTE [CLIP pooling
//                                                                 rule] in clip_text_config.h)
// Every projection has a bias; the norms are affine LayerNorms (ops/layer_norm.h); act is
// quick GELU for CLIP-L (ops/gelu.h). Without a mask, padding after the end-of-text token
// is attended to by later positions only, so the causal mask alone keeps it out of the
// pooled row, and the padded positions' own rows are what transformers computes too.
// The code is the same on the CPU reference (fp32) and on CUDA (bf16, statistics fp32).
//
// NOTE [CLIP text parameters]
// The parameters carry transformers' names as CLIPTextModel's state dict has them
// ("embeddings.token_embedding.weight", "encoder.layers.3.self_attn.q_proj.bias", ...;
// files written by transformers 4 prefix them with "text_model.", ckpt/clip_text_weights.h).
// They live in one flat buffer, each tensor starting on a multiple of 64 values, except
// that each layer's k and v projections follow its q projection directly, weights and
// biases alike: the three are then one [3 D, D] weight and one [3 D] bias, the fused QKV
// projection whose output attention reads as [B, T, 3 H, D / H] (queries, keys, values).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/clip_text_config.h"
#include "ops/linear.h"

namespace forge {

struct ClipTextParameterSpec {
  std::string name;  // transformers' name, without "text_model."
  Shape shape;
  bool follows_previous = false;  // NOTE [CLIP text parameters]: k and v right after q
};

// Every parameter in the order of the flat buffer.
std::vector<ClipTextParameterSpec> clip_text_parameter_specs(const ClipTextConfig& config);

class ClipTextParameters {
 public:
  struct Layer {
    Tensor norm1_weight, norm1_bias;
    LinearWeight qkv, out;
    Tensor norm2_weight, norm2_bias;
    LinearWeight fc1, fc2;
  };

  // Zeros, in `dtype` (fp32 on the CPU; bf16 or fp32 on CUDA) on `device`.
  explicit ClipTextParameters(const ClipTextConfig& config, Device device = Device::CPU, DType dtype = DType::F32);

  const ClipTextConfig& config() const { return config_; }
  const std::vector<ClipTextParameterSpec>& specs() const { return specs_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }  // one per spec
  // The tensor of that name; throws naming it when the model has none.
  const Tensor& tensor(const std::string& name) const;
  // Copies every value of `other` (same config), converting device and dtype.
  void assign_from(const ClipTextParameters& other);

  const Tensor& token_embedding() const { return token_embedding_; }
  const Tensor& position_embedding() const { return position_embedding_; }
  const Layer& layer(int64_t index) const { return layers_.at(static_cast<size_t>(index)); }
  const Tensor& final_norm_weight() const { return final_norm_weight_; }
  const Tensor& final_norm_bias() const { return final_norm_bias_; }

 private:
  ClipTextConfig config_;
  std::vector<ClipTextParameterSpec> specs_;
  Tensor flat_;
  std::vector<Tensor> tensors_;
  Tensor token_embedding_, position_embedding_, final_norm_weight_, final_norm_bias_;
  std::vector<Layer> layers_;
};

// The row of each caption that pooler_output takes (NOTE [CLIP pooling rule]); tokens holds
// `batch` rows of `seq` ids.
std::vector<int64_t> clip_pooled_positions(const ClipTextConfig& config, const std::vector<int32_t>& tokens,
                                           int64_t batch, int64_t seq);

// The forward of `batch` captions of `seq` tokens (seq <= max_positions) on one device, its
// activations allocated once.
class ClipTextEncoder {
 public:
  ClipTextEncoder(const ClipTextConfig& config, int64_t batch, int64_t seq, Device device);

  int64_t batch() const { return batch_; }
  int64_t seq() const { return seq_; }
  DType dtype() const { return dtype_; }

  // tokens: batch x seq ids, each in [0, vocab_size) (checked). Writes last_hidden [batch,
  // seq, hidden] and pooled [batch, hidden], in the compute dtype on the encoder's device,
  // from `params` (same config, same device and dtype).
  void forward(const std::vector<int32_t>& tokens, const ClipTextParameters& params, const Tensor& last_hidden,
               const Tensor& pooled);

 private:
  ClipTextConfig config_;
  int64_t batch_, seq_;
  Device device_;
  DType dtype_;
  Tensor ids_, positions_, h_, normed_, embedded_, qkv_, attention_, lse_, mlp_, activated_;
};

}  // namespace forge
