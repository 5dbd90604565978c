// T5Config: the architecture of the T5 v1.1 encoder, FLUX.1's text encoder
// (diffusers' FluxPipeline.text_encoder_2, transformers' T5EncoderModel of
// google/t5-v1_1-xxl), run inference-only to turn each caption into the [512,
// 4096] text features FLUX trains on.
//
// NOTE [T5 encoder architecture]
// Token ids go through the embedding table (`shared`), then num_layers blocks,
// each two pre-norm residual branches:
//   h += o(attention(q(n), k(n), v(n)) + position bias),  n = RMSNorm(h)
//   (layer.0) h += wo(gelu_tanh(wi_0(n)) * wi_1(n)),                n =
//   RMSNorm(h)   (layer.1)
// and a final RMSNorm. The RMSNorm is T5LayerNorm (no mean, no bias, scale
// only, epsilon inside the root). Attention has num_heads heads of d_kv (their
// total need not equal d_model), no biases anywhere, and no 1/sqrt(d_kv)
// scaling: the initialization folded it into q. Positions enter only as a bias
// added to the scores: bias[h, i, j] is the relative_attention_bias embedding
// [num_buckets, num_heads] at the bucket of j - i (t5_relative_position_bucket,
// bidirectional), computed by the first block and shared by all (only block 0
// has the table). The feed-forward is gated GELU (feed_forward_proj
// "gated-gelu": T5 v1.1's, dense_act_fn "gelu_new", the tanh approximation).
// Dropout is off (inference). FluxPipeline calls the encoder without an
// attention mask: the pad tokens after a caption's EOS are attended to like any
// other (data/t5_prompt_tokenizer.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace forge {

struct T5Config {
  std::string name;
  int64_t vocab_size = 32128;
  int64_t d_model = 4096;
  int64_t d_kv = 64;
  int64_t num_heads = 64;
  int64_t d_ff = 10240;
  int64_t num_layers = 24;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;

  int64_t inner_dim() const { return num_heads * d_kv; }

  // Throws naming the bad knob and `source` (the file or preset it came from).
  void validate(std::string_view source = "T5 config") const;
  // Every parameter (the embedding counted once).
  int64_t parameter_count() const;
};

// google/t5-v1_1-xxl's encoder, FLUX.1's text_encoder_2 ("t5-v1_1-xxl"):
// 4,762,310,656 parameters.
T5Config t5_v1_1_xxl_config();

// A transformers config.json of a T5 encoder, read as transformers' T5Config
// reads it (keys left out take its defaults). Anything forge would compute
// differently is refused naming the file and the key: model_type other than
// "t5", a feed-forward other than gated GELU in its tanh form
// (feed_forward_proj "gated-gelu", or is_gated_act / dense_act_fn set to
// something else), bucket counts and distances the bucket function cannot use.
T5Config read_t5_config(const std::string& path);

}  // namespace forge
