// The T5 v1.1 encoder (NOTE [T5 encoder architecture] in t5_config.h),
// inference only: its weights under transformers' names (T5Weights), the
// relative position buckets, and the forward (T5Encoder), on the CPU reference
// in fp32 or on CUDA in bf16, composed from the op families: embedding,
// rmsnorm, linear, dense_attention (ops/dense_attention.h: scores with the
// position bias, no scaling), gelu_tanh and the product of the gated
// feed-forward.
//
// NOTE [T5 precision]
// transformers runs FLUX's T5 in bf16 with one exception: T5 keeps its `wo`
// projections in fp32 (_keep_in_fp32_modules, after google/flan-t5-xxl
// overflowed in fp16), casting their input up; the residual stream h + wo(...)
// is then fp32 from the first block's feed-forward on, and each T5LayerNorm
// computes its variance in fp32 from it, rounding only its output to bf16.
// forge on CUDA keeps the same shape of precision: the residual stream h is
// fp32 from the embedding on; the o and wo projections read bf16 activations
// and weights, accumulate in fp32 and add into h in fp32 (the GEMM's C
// operand), so no branch is rounded to bf16 before it joins the stream; each
// RMSNorm reads h rounded to bf16 once (the norm op's input dtype), computes
// its statistics in fp32 and writes bf16. Attention scores, the position bias
// add and the softmax are fp32 (NOTE [Dense attention on the GPU]); q, k, v,
// the probabilities, the feed-forward's activations and the output are bf16.
// The fp16 clamp of transformers (inf replaced by the largest finite value
// after each branch, only when the stream is fp16) has no counterpart: forge
// never computes in fp16, and bf16 and fp32 share fp32's range. The output [B,
// L, d_model] is bf16, as FluxPipeline casts prompt_embeds to the encoder's
// dtype. The CPU reference computes everything in fp32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/t5_config.h"

namespace forge {

// transformers' T5Attention._relative_position_bucket, bidirectional (the
// encoder's): relative_position = key position - query position; half the
// buckets for keys after the query, in each half `num_buckets / 4` exact
// distances, then logarithmically wider bins up to max_distance, beyond which
// all share the last bucket. Computed in fp32 as PyTorch computes it (the bins'
// edges hang on float rounding: distance 16 of the default 32/128 lands on 2.0
// exactly).
int64_t t5_relative_position_bucket(int64_t relative_position, int64_t num_buckets, int64_t max_distance);

// The position bias [heads, length, length] (fp32, CPU): bias[h, i, j] =
// table[bucket(j - i), h], table [num_buckets, heads] (fp32, CPU).
Tensor t5_position_bias(const T5Config& config, const Tensor& table, int64_t length);

// One tensor of the encoder under its transformers name.
struct T5TensorSpec {
  std::string name;
  Shape shape;
};

// Every tensor of a T5EncoderModel in its state_dict's order: shared.weight
// (the embedding, which encoder.embed_tokens.weight ties to), then each block's
// layer.0.SelfAttention.q/k/v/o (block 0 also
// SelfAttention.relative_attention_bias), layer.0.layer_norm,
// layer.1.DenseReluDense.wi_0/wi_1/wo and layer.1.layer_norm (names under
// encoder.block.N.), then encoder.final_layer_norm.weight.
std::vector<T5TensorSpec> t5_tensor_specs(const T5Config& config);

struct T5BlockWeights {
  Tensor attention_norm, q, k, v,
      o;  // [d_model]; [inner, d_model] x 3; [d_model, inner]
  Tensor feed_forward_norm, wi_0, wi_1,
      wo;  // [d_model]; [d_ff, d_model] x 2; [d_model, d_ff]
};

// The encoder's weights in one buffer on one device: fp32 on the CPU, bf16 on
// CUDA. Tensor i is specs()[i].
class T5Weights {
 public:
  // Allocated and zeroed.
  T5Weights(const T5Config& config, Device device = Device::CPU, DType dtype = DType::F32);

  const T5Config& config() const { return config_; }
  Device device() const { return flat_.device(); }
  DType dtype() const { return flat_.dtype(); }
  const std::vector<T5TensorSpec>& specs() const { return specs_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }

  const Tensor& embedding() const { return tensors_.front(); }                        // [vocab, d_model]
  const Tensor& relative_attention_bias() const { return relative_attention_bias_; }  // [num_buckets, heads]
  const T5BlockWeights& block(int64_t i) const { return blocks_.at(static_cast<size_t>(i)); }
  const Tensor& final_norm() const { return tensors_.back(); }  // [d_model]

  // Writes fp32 host values (the tensor's numel) into tensor `index`, converted
  // to this holder's dtype and device.
  void write(size_t index, const float* values) const;
  // Copies every value of `other` (the same config), converting dtype and
  // device.
  void assign_from(const T5Weights& other) const;
  // Random weights for tests: matrices Normal(0, 1 / sqrt(fan_in)) (the
  // embedding and the bias table Normal(0, 1)), norm scales 1 + Normal(0, 0.1).
  void initialize(uint64_t seed) const;

 private:
  T5Config config_;
  std::vector<T5TensorSpec> specs_;
  Tensor flat_;
  std::vector<Tensor> tensors_;
  std::vector<T5BlockWeights> blocks_;
  Tensor relative_attention_bias_;
};

// The forward of the encoder over the weights it is given (they must outlive
// it), with its working buffers kept between calls of the same shape. On CUDA
// d_model and d_ff must be multiples of 8 (the norm, embedding and
// gated-product kernels' vectors).
class T5Encoder {
 public:
  explicit T5Encoder(const T5Weights& weights);

  // tokens: int32 host tensor [B, L] of ids in [0, vocab_size) (checked, naming
  // the position of a bad one); out [B, L, d_model] on the weights' device in
  // their dtype.
  void forward(const Tensor& tokens, const Tensor& out);

 private:
  void plan(int64_t batch, int64_t length);
  const Tensor& norm_input();

  const T5Weights& weights_;
  int64_t batch_ = -1, length_ = -1;
  Tensor ids_, h_, h_compute_, n_, rstd_, q_, k_, v_, attention_, gate_, up_, activated_, bias_;
};

}  // namespace forge
