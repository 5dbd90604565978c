// The T5 encoder's weights and forward; see t5_encoder.h, NOTE [T5 encoder
// architecture] in t5_config.h and NOTE [T5 precision].
//
// Shapes: B captions of L tokens, N = B L rows, D = d_model, H heads of dk (I =
// H dk), F = d_ff. The residual stream h is [N, D] fp32 on both devices;
// projections take 2-D views [N, features], attention views them [B, L, H, dk].
#include "model/t5_encoder.h"

#include <algorithm>
#include <cmath>

#include "core/rng.h"
#include "ops/dense_attention.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gated_residual.h"
#include "ops/gelu.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"

namespace forge {

int64_t t5_relative_position_bucket(int64_t relative_position, int64_t num_buckets, int64_t max_distance) {
  const int64_t half = num_buckets / 2;
  const int64_t base = relative_position > 0 ? half : 0;
  const int64_t distance = relative_position < 0 ? -relative_position : relative_position;
  const int64_t exact = half / 2;
  if (distance < exact) return base + distance;
  // PyTorch's float32 arithmetic: log(float(distance) / exact), divided by the
  // double log(max_distance / exact) rounded to float, times (half - exact),
  // truncated.
  const float ratio = static_cast<float>(distance) / static_cast<float>(exact);
  const auto log_span = static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(exact)));
  const float scaled = std::log(ratio) / log_span * static_cast<float>(half - exact);
  return base + std::min(exact + static_cast<int64_t>(scaled), half - 1);
}

Tensor t5_position_bias(const T5Config& config, const Tensor& table, int64_t length) {
  const int64_t heads = config.num_heads, buckets = config.relative_attention_num_buckets;
  FORGE_CHECK(table.device() == Device::CPU && table.dtype() == DType::F32,
              "t5_position_bias: the bias table must be fp32 on the CPU");
  check_shape(table, {buckets, heads}, "t5_position_bias table");
  // Every query-key pair at one distance shares a bucket: one lookup per
  // distance.
  std::vector<int64_t> bucket_of(static_cast<size_t>(2 * length + 1));
  for (int64_t r = -length; r <= length; ++r)
    bucket_of[static_cast<size_t>(r + length)] =
        t5_relative_position_bucket(r, buckets, config.relative_attention_max_distance);
  Tensor bias = Tensor::empty({heads, length, length});
  float* out = bias.data<float>();
  const float* t = table.data<float>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < length; ++i)
      for (int64_t j = 0; j < length; ++j)
        out[(h * length + i) * length + j] = t[bucket_of[static_cast<size_t>(j - i + length)] * heads + h];
  return bias;
}

std::vector<T5TensorSpec> t5_tensor_specs(const T5Config& c) {
  const int64_t d = c.d_model, inner = c.inner_dim(), f = c.d_ff;
  std::vector<T5TensorSpec> specs{{"shared.weight", {c.vocab_size, d}}};
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "encoder.block." + std::to_string(i) + ".layer.";
    for (const char* proj : {"q", "k", "v"}) specs.push_back({p + "0.SelfAttention." + proj + ".weight", {inner, d}});
    specs.push_back({p + "0.SelfAttention.o.weight", {d, inner}});
    if (i == 0)
      specs.push_back(
          {p + "0.SelfAttention.relative_attention_bias.weight", {c.relative_attention_num_buckets, c.num_heads}});
    specs.push_back({p + "0.layer_norm.weight", {d}});
    specs.push_back({p + "1.DenseReluDense.wi_0.weight", {f, d}});
    specs.push_back({p + "1.DenseReluDense.wi_1.weight", {f, d}});
    specs.push_back({p + "1.DenseReluDense.wo.weight", {d, f}});
    specs.push_back({p + "1.layer_norm.weight", {d}});
  }
  specs.push_back({"encoder.final_layer_norm.weight", {d}});
  return specs;
}

namespace {

// Each tensor starts on a multiple of 64 values (16-byte vectors for the
// kernels).
int64_t aligned(int64_t values) { return (values + 63) / 64 * 64; }

}  // namespace

T5Weights::T5Weights(const T5Config& config, Device device, DType dtype)
    : config_(config), specs_(t5_tensor_specs(config)) {
  config_.validate(config_.name.empty() ? "T5 config" : config_.name);
  FORGE_CHECK((device == Device::CPU) == (dtype == DType::F32),
              "T5Weights: fp32 on the CPU or bf16 on CUDA (NOTE [Op "
              "placement]), asked for {} on {}",
              dtype_name(dtype), device_name(device));
  int64_t total = 0;
  for (const T5TensorSpec& s : specs_) total += aligned(shape_numel(s.shape));
  flat_ = Tensor::zeros({total}, dtype, device);
  int64_t offset = 0;
  for (const T5TensorSpec& s : specs_) {
    tensors_.push_back(flat_.narrow(offset, offset + shape_numel(s.shape)).view(s.shape));
    offset += aligned(shape_numel(s.shape));
  }
  size_t i = 1;
  for (int64_t b = 0; b < config_.num_layers; ++b) {
    T5BlockWeights w;
    w.q = tensors_[i++];
    w.k = tensors_[i++];
    w.v = tensors_[i++];
    w.o = tensors_[i++];
    if (b == 0) relative_attention_bias_ = tensors_[i++];
    w.attention_norm = tensors_[i++];
    w.wi_0 = tensors_[i++];
    w.wi_1 = tensors_[i++];
    w.wo = tensors_[i++];
    w.feed_forward_norm = tensors_[i++];
    blocks_.push_back(w);
  }
}

void T5Weights::write(size_t index, const float* values) const {
  const Tensor& dst = tensors_.at(index);
  const Tensor host = Tensor::wrap(const_cast<float*>(values), dst.shape(), DType::F32);
  if (dst.dtype() == DType::F32) {
    dst.copy_from(host);
    return;
  }
  Tensor converted = Tensor::empty(dst.shape(), dst.dtype());
  cast(converted, host);
  dst.copy_from(converted);
}

void T5Weights::assign_from(const T5Weights& other) const {
  FORGE_CHECK(other.flat_.numel() == flat_.numel(), "T5Weights::assign_from: {} values into {}", other.flat_.numel(),
              flat_.numel());
  if (other.flat_.device() == flat_.device())
    cast(flat_, other.flat_);
  else if (other.flat_.dtype() == flat_.dtype())
    flat_.copy_from(other.flat_);
  else if (flat_.device() == Device::CPU)
    cast(flat_, other.flat_.to(Device::CPU));
  else {
    Tensor converted = Tensor::empty(flat_.shape(), flat_.dtype());
    cast(converted, other.flat_);
    flat_.copy_from(converted);
  }
}

void T5Weights::initialize(uint64_t seed) const {
  if (flat_.device() != Device::CPU || flat_.dtype() != DType::F32) {
    T5Weights host(config_);
    host.initialize(seed);
    assign_from(host);
    return;
  }
  Rng rng(seed);
  for (size_t i = 0; i < specs_.size(); ++i) {
    const Shape& shape = specs_[i].shape;
    float* p = tensors_[i].data<float>();
    const int64_t n = shape_numel(shape);
    const bool table = i == 0 || tensors_[i].raw() == relative_attention_bias_.raw();
    const double scale = shape.size() == 1 ? 0.1 : table ? 1.0 : 1.0 / std::sqrt(static_cast<double>(shape[1]));
    for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>((shape.size() == 1 ? 1.0 : 0.0) + scale * rng.normal());
  }
}

T5Encoder::T5Encoder(const T5Weights& weights) : weights_(weights) {
  const T5Config& c = weights.config();
  if (weights.device() == Device::CUDA)
    FORGE_CHECK(c.d_model % 8 == 0 && c.d_ff % 8 == 0,
                "T5 encoder on CUDA: d_model ({}) and d_ff ({}) must be multiples of 8", c.d_model, c.d_ff);
}

void T5Encoder::plan(int64_t batch, int64_t length) {
  if (batch == batch_ && length == length_) return;
  const T5Config& c = weights_.config();
  const Device dev = weights_.device();
  const DType dt = weights_.dtype();
  const int64_t rows = batch * length;
  ids_ = Tensor::empty({rows}, DType::I32, dev);
  h_ = Tensor::empty({rows, c.d_model}, DType::F32, dev);
  if (dt != DType::F32) h_compute_ = Tensor::empty({rows, c.d_model}, dt, dev);
  n_ = Tensor::empty({rows, c.d_model}, dt, dev);
  rstd_ = Tensor::empty({rows}, DType::F32, dev);
  for (Tensor* t : {&q_, &k_, &v_, &attention_}) *t = Tensor::empty({rows, c.inner_dim()}, dt, dev);
  for (Tensor* t : {&gate_, &up_, &activated_}) *t = Tensor::empty({rows, c.d_ff}, dt, dev);
  if (length != length_) {
    Tensor table = Tensor::empty(weights_.relative_attention_bias().shape());
    cast(table, weights_.relative_attention_bias().to(Device::CPU));
    const Tensor bias = t5_position_bias(c, table, length);
    bias_ = Tensor::empty(bias.shape(), dt, dev);
    if (dt == DType::F32) {
      bias_.copy_from(bias);
    } else {
      Tensor converted = Tensor::empty(bias.shape(), dt);
      cast(converted, bias);
      bias_.copy_from(converted);
    }
  }
  batch_ = batch;
  length_ = length;
}

// What an RMSNorm reads: the fp32 stream itself on the CPU, else its bf16
// rounding.
const Tensor& T5Encoder::norm_input() {
  if (weights_.dtype() == DType::F32) return h_;
  cast(h_compute_, h_);
  return h_compute_;
}

void T5Encoder::forward(const Tensor& tokens, const Tensor& out) {
  const T5Config& c = weights_.config();
  FORGE_CHECK(tokens.ndim() == 2 && tokens.device() == Device::CPU && tokens.dtype() == DType::I32,
              "T5 encoder: tokens must be an int32 host tensor [batch, "
              "length], got {} {} on {}",
              dtype_name(tokens.dtype()), shape_str(tokens.shape()), device_name(tokens.device()));
  const int64_t batch = tokens.dim(0), length = tokens.dim(1), rows = batch * length;
  check_shape(out, {batch, length, c.d_model}, "T5 encoder out");
  FORGE_CHECK(out.device() == weights_.device() && out.dtype() == weights_.dtype(),
              "T5 encoder: out must be {} on {} like the weights, got {} on {}", dtype_name(weights_.dtype()),
              device_name(weights_.device()), dtype_name(out.dtype()), device_name(out.device()));
  const int32_t* ids = tokens.data<int32_t>();
  for (int64_t i = 0; i < rows; ++i)
    FORGE_CHECK(ids[i] >= 0 && ids[i] < c.vocab_size,
                "T5 encoder: token id {} at caption {} position {} is outside "
                "the vocabulary [0, {})",
                ids[i], i / std::max<int64_t>(length, 1), i % std::max<int64_t>(length, 1), c.vocab_size);
  if (rows == 0) return;
  plan(batch, length);
  ids_.copy_from(tokens.view({rows}));

  // The embedding into the fp32 stream (on CUDA through the bf16 rows of the
  // table).
  if (weights_.dtype() != DType::F32) {
    embedding_forward(n_, ids_, weights_.embedding());
    cast(h_, n_);
  } else {
    embedding_forward(h_, ids_, weights_.embedding());
  }
  const Shape heads{batch, length, c.num_heads, c.d_kv};
  const float eps = static_cast<float>(c.layer_norm_epsilon);
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const T5BlockWeights& w = weights_.block(layer);
    rmsnorm_forward(n_, rstd_, norm_input(), w.attention_norm, eps);
    linear_forward(q_, n_, LinearWeight{w.q});
    linear_forward(k_, n_, LinearWeight{w.k});
    linear_forward(v_, n_, LinearWeight{w.v});
    dense_attention_forward(attention_.view(heads), q_.view(heads), k_.view(heads), v_.view(heads), &bias_, 1.0f);
    linear_forward(h_, attention_, LinearWeight{w.o}, &h_);

    rmsnorm_forward(n_, rstd_, norm_input(), w.feed_forward_norm, eps);
    linear_forward(gate_, n_, LinearWeight{w.wi_0});
    gelu_tanh_forward(activated_, gate_);
    linear_forward(up_, n_, LinearWeight{w.wi_1});
    // gelu(wi_0 n) * wi_1 n: the gated residual add over a zeroed buffer, one
    // token per "sample" so that the gate is the activated row itself.
    gate_.fill_zero();
    gated_residual_forward(gate_.view({rows, 1, c.d_ff}), up_.view({rows, 1, c.d_ff}), activated_);
    linear_forward(h_, gate_, LinearWeight{w.wo}, &h_);
  }
  rmsnorm_forward(out.view({rows, c.d_model}), rstd_, norm_input(), weights_.final_norm(), eps);
}

}  // namespace forge
