#include "model/incremental_decoder.h"

#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"

namespace forge {
namespace {

// The model as decoded: dropless (NOTE [Incremental decoding]).
ModelConfig decoded(ModelConfig config) {
  config.validate();
  config.moe_capacity_factor = 0.0;
  config.moe_pad_to_capacity = false;
  config.moe_token_drop_policy = "probs";
  return config;
}

} // namespace

IncrementalDecoder::IncrementalDecoder(const ModelConfig &config,
                                       int64_t capacity, Device device,
                                       DType compute_dtype)
    : config_(decoded(config)), capacity_(capacity), device_(device),
      dtype_(compute_dtype), hidden_(config.hidden_size),
      eps_(static_cast<float>(config.norm_eps)) {
  FORGE_CHECK(capacity >= 1, "a KV cache of {} positions", capacity);
  FORGE_CHECK(device == Device::CUDA ? compute_dtype == DType::BF16
                                     : compute_dtype == DType::F32,
              "compute dtype {} on {} (NOTE [Op placement])",
              dtype_name(compute_dtype), device_name(device));
  components_ = make_block_components(config_);
  for (const auto &component : components_) {
    cached_.push_back(make_cached_attention(*component, config_, capacity,
                                            device, compute_dtype));
    if (!cached_.back() && !component->position_wise()) {
      const std::vector<ParamSpec> specs = component->param_specs(0);
      FORGE_FAIL("incremental decoding (NOTE [Incremental decoding]) does not "
                 "know the block component declaring '{}'",
                 specs.empty() ? std::string("no parameters")
                               : specs.front().name);
    }
  }
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    std::vector<size_t> first{0};
    for (const auto &component : components_)
      first.push_back(first.back() + component->param_specs(layer).size());
    first_param_.push_back(std::move(first));
  }
}

void IncrementalDecoder::lay_out_step(int64_t tokens) {
  if (tokens == step_tokens_)
    return;
  const StepShape shape{1, tokens, dtype_};
  const int64_t n = tokens;
  auto lay_out = [&](ArenaLayout &layout) {
    stream_[0] = layout.take({n, hidden_}, dtype_);
    stream_[1] = layout.take({n, hidden_}, dtype_);
    final_normed_ = layout.take({n, hidden_}, dtype_);
    final_rstd_ = layout.take({n}, DType::F32);
    for (size_t c = 0; c < components_.size(); ++c) {
      if (cached_[c])
        cached_[c]->lay_out(layout, n);
      else
        components_[c]->lay_out(layout, shape, ActivationCheckpoint::Full,
                                config_.num_layers);
    }
  };
  ArenaLayout counting(nullptr, device_);
  lay_out(counting);
  arena_ = Tensor();
  arena_ = Tensor::empty({counting.bytes()}, DType::U8, device_);
  ArenaLayout layout(arena_.raw(), device_);
  lay_out(layout);
  for (size_t c = 0; c < components_.size(); ++c)
    if (!cached_[c])
      components_[c]->prepare(shape, device_);
  step_tokens_ = tokens;
}

void IncrementalDecoder::forward(const Tensor &tokens, ParamSource &weights,
                                 const Tensor &logits) {
  FORGE_CHECK(tokens.ndim() == 1 && tokens.numel() >= 1,
              "tokens {} must be [n], n >= 1", shape_str(tokens.shape()));
  FORGE_CHECK(tokens.dtype() == DType::I32 && tokens.device() == device_,
              "tokens must be int32 on {}", device_name(device_));
  const int64_t n = tokens.numel();
  FORGE_CHECK(position_ + n <= capacity_,
              "positions {} .. {} exceed the KV cache's {} positions",
              position_, position_ + n - 1, capacity_);
  const int64_t rows = logits.ndim() == 2 ? logits.dim(0) : -1;
  FORGE_CHECK(rows >= 0 && rows <= n && logits.dim(1) == config_.vocab_size,
              "logits {} must be [rows <= {}, {}]", shape_str(logits.shape()),
              n, config_.vocab_size);
  FORGE_CHECK(
      rows == 0 || (logits.dtype() == dtype_ && logits.device() == device_),
      "logits must be {} on {}", dtype_name(dtype_), device_name(device_));
  lay_out_step(n);
  embedding_forward(stream_[0], tokens, weights.embedding());
  int current = 0;
  for (int i = 0; i < config_.num_layers; ++i) {
    const BlockWeights &block = weights.layer(i);
    const std::vector<size_t> &first = first_param_[static_cast<size_t>(i)];
    FORGE_CHECK(block.params.size() == first.back(),
                "block {}'s weights hold {} parameters, its components {}", i,
                block.params.size(), first.back());
    for (size_t c = 0; c < components_.size(); ++c) {
      const ComponentWeights w(block, first[c], first[c + 1] - first[c]);
      const Tensor &x = stream_[current];
      const Tensor &y = stream_[1 - current];
      if (cached_[c])
        cached_[c]->forward(i, w, x, y, position_);
      else
        components_[c]->forward(i, w, x, &y);
      current = 1 - current;
    }
  }
  if (rows > 0) {
    rmsnorm_forward(final_normed_.narrow(0, rows), final_rstd_.narrow(0, rows),
                    stream_[current].narrow(n - rows, n), weights.final_norm(),
                    eps_);
    linear_forward(logits, final_normed_.narrow(0, rows), weights.output());
  }
  position_ += n;
}

} // namespace forge
