// FluxPromptEncoder: NOTE [FLUX prompt encoding] in flux_prompt_encoder.h.
#include "train/flux_prompt_encoder.h"

#include "ckpt/clip_text_weights.h"
#include "ckpt/t5_weights.h"
#include "core/error.h"
#include "data/clip_tokenizer.h"
#include "data/t5_prompt_tokenizer.h"
#include "model/clip_text_encoder.h"
#include "model/t5_encoder.h"
#include "ops/elementwise.h"

namespace forge {

struct FluxPromptEncoder::Models {
  T5PromptTokenizer t5_tokenizer;
  T5Weights t5;
  T5Encoder t5_encoder;
  ClipTokenizer clip_tokenizer;
  ClipTextParameters clip;

  Models(const FluxPromptFiles& f, Device device)
      : t5_tokenizer(f.t5_tokenizer),
        t5(load_t5_encoder(f.t5, device, device == Device::CUDA ? DType::BF16 : DType::F32)),
        t5_encoder(t5),
        clip_tokenizer(f.clip_tokenizer),
        clip(read_clip_text_encoder_config(f.clip), device, device == Device::CUDA ? DType::BF16 : DType::F32) {
    if (device == Device::CPU) {
      load_clip_text_weights(f.clip, clip);
    } else {
      ClipTextParameters host(clip.config());
      load_clip_text_weights(f.clip, host);
      clip.assign_from(host);
    }
  }
};

FluxPromptEncoder::FluxPromptEncoder(const FluxPromptFiles& files, Device device, int64_t text_tokens)
    : device_(device), text_tokens_(text_tokens) {
  if (!(text_tokens >= 1)) FORGE_FAIL("FLUX prompts: {} T5 tokens per caption; at least 1", text_tokens);
  models_ = std::make_unique<Models>(files, device);
  const ClipTextConfig& clip = models_->clip.config();
  if (!(clip.max_positions >= kClipTokens))
    FORGE_FAIL("{}: CLIP's max_position_embeddings is {}; FluxPipeline feeds it {} tokens", files.clip,
               clip.max_positions, kClipTokens);
  if (!(models_->clip_tokenizer.vocab_size() <= clip.vocab_size))
    FORGE_FAIL("CLIP's tokenizer at {} has {} tokens, more than the encoder's vocab_size {} ({})", files.clip_tokenizer,
               models_->clip_tokenizer.vocab_size(), clip.vocab_size, files.clip);
  if (!(models_->t5_tokenizer.vocab_size() <= models_->t5.config().vocab_size))
    FORGE_FAIL("T5's tokenizer {} has {} pieces, more than the encoder's vocab_size {} ({})",
               models_->t5_tokenizer.file(), models_->t5_tokenizer.vocab_size(), models_->t5.config().vocab_size,
               files.t5);
}

FluxPromptEncoder::~FluxPromptEncoder() = default;

int64_t FluxPromptEncoder::text_dim() const { return models_->t5.config().d_model; }
int64_t FluxPromptEncoder::pooled_dim() const { return models_->clip.config().hidden_size; }

void FluxPromptEncoder::encode(const std::vector<std::string>& captions, const Tensor& text, const Tensor& pooled) {
  const int64_t n = static_cast<int64_t>(captions.size());
  const Shape text_shape{n, text_tokens_, text_dim()}, pooled_shape{n, pooled_dim()};
  if (!(text.device() == Device::CPU && text.dtype() == DType::F32 && text.shape() == text_shape))
    FORGE_FAIL("FLUX prompts: text must be fp32 {} on the CPU, got {}", shape_str(text_shape), shape_str(text.shape()));
  if (!(pooled.device() == Device::CPU && pooled.dtype() == DType::F32 && pooled.shape() == pooled_shape))
    FORGE_FAIL("FLUX prompts: pooled must be fp32 {} on the CPU, got {}", shape_str(pooled_shape),
               shape_str(pooled.shape()));
  if (n == 0) return;
  const DType dtype = device_ == Device::CUDA ? DType::BF16 : DType::F32;
  // T5, one caption at a time (its dense attention's scores grow with the batch).
  const Tensor ids = Tensor::empty({1, text_tokens_}, DType::I32);
  const Tensor features = Tensor::empty({1, text_tokens_, text_dim()}, dtype, device_);
  const Tensor wide = Tensor::empty(features.shape(), DType::F32, device_);
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int32_t> row = models_->t5_tokenizer.prompt_ids(captions[static_cast<size_t>(i)], text_tokens_);
    std::copy(row.begin(), row.end(), ids.data<int32_t>());
    models_->t5_encoder.forward(ids, features);
    cast(wide, features);
    text.narrow(i, i + 1).copy_from(wide);
  }
  // CLIP, all captions in one batch.
  const std::vector<int32_t> clip_ids = models_->clip_tokenizer.encode_padded_batch(captions, kClipTokens);
  ClipTextEncoder clip(models_->clip.config(), n, kClipTokens, device_);
  const Tensor hidden = Tensor::empty({n, kClipTokens, pooled_dim()}, dtype, device_);
  const Tensor pooled_out = Tensor::empty(pooled_shape, dtype, device_);
  clip.forward(clip_ids, models_->clip, hidden, pooled_out);
  const Tensor pooled_wide = Tensor::empty(pooled_shape, DType::F32, device_);
  cast(pooled_wide, pooled_out);
  pooled.copy_from(pooled_wide);
}

}  // namespace forge
