// FluxPromptEncoder: NOTE [FLUX prompt encoding] in flux_prompt_encoder.h.
#include "train/flux_prompt_encoder.h"

#include <filesystem>
#include <map>
#include <optional>

#include "ckpt/clip_text_weights.h"
#include "ckpt/t5_weights.h"
#include "core/error.h"
#include "core/parallel.h"
#include "data/clip_tokenizer.h"
#include "data/t5_prompt_tokenizer.h"
#include "model/clip_text_encoder.h"
#include "model/t5_config.h"
#include "model/t5_encoder.h"
#include "ops/convert.h"

namespace forge {

namespace {

DType compute_dtype(Device device) { return device == Device::CUDA ? DType::BF16 : DType::F32; }

}  // namespace

struct FluxPromptEncoder::Models {
  T5PromptTokenizer t5_tokenizer;
  ClipTokenizer clip_tokenizer;
  ClipTextConfig clip_config;
  std::optional<T5Weights> t5;
  std::optional<T5Encoder> t5_encoder;
  std::unique_ptr<ClipTextParameters> clip;
  std::map<int64_t, std::unique_ptr<ClipTextEncoder>> clip_encoders;  // per batch size

  // The small files first (both tokenizers, both configs), checked against each other, so
  // that a bad one fails before the weights load.
  Models(const FluxPromptFiles& f, Device device)
      : t5_tokenizer(f.t5_tokenizer),
        clip_tokenizer(f.clip_tokenizer),
        clip_config(read_clip_text_encoder_config(f.clip)) {
    if (!(clip_config.max_positions >= kClipTokens))
      FORGE_FAIL("{} {}: CLIP's max_position_embeddings is {}; FluxPipeline feeds it {} tokens", f.clip_flag, f.clip,
                 clip_config.max_positions, kClipTokens);
    if (!(clip_tokenizer.vocab_size() <= clip_config.vocab_size))
      FORGE_FAIL("{} {}: {} tokens, but the CLIP encoder at {} has {} token embeddings", f.clip_tokenizer_flag,
                 f.clip_tokenizer, clip_tokenizer.vocab_size(), f.clip, clip_config.vocab_size);
    const std::string t5_config_file =
        (std::filesystem::path(t5_encoder_folder(f.t5)) / "config.json").string();
    const int64_t t5_vocab = read_t5_config(t5_config_file).vocab_size;
    if (!(t5_tokenizer.vocab_size() <= t5_vocab))
      FORGE_FAIL("{} {}: {} pieces ({}), but the T5 encoder at {} has {} token embeddings", f.t5_tokenizer_flag,
                 f.t5_tokenizer, t5_tokenizer.vocab_size(), t5_tokenizer.file(), f.t5, t5_vocab);

    t5.emplace(load_t5_encoder(f.t5, device, compute_dtype(device)));
    t5_encoder.emplace(*t5);
    auto host = std::make_unique<ClipTextParameters>(clip_config);
    load_clip_text_weights(f.clip, *host);
    if (device == Device::CPU) {
      clip = std::move(host);
    } else {
      clip = std::make_unique<ClipTextParameters>(clip_config, device, compute_dtype(device));
      clip->assign_from(*host);
    }
  }
};

FluxPromptEncoder::FluxPromptEncoder(const FluxPromptFiles& files, Device device, int64_t text_tokens)
    : device_(device), text_tokens_(text_tokens) {
  if (!(text_tokens >= 1)) FORGE_FAIL("FLUX prompts: {} T5 tokens per caption; at least 1", text_tokens);
  models_ = std::make_unique<Models>(files, device);
}

FluxPromptEncoder::~FluxPromptEncoder() = default;

DType FluxPromptEncoder::dtype() const { return compute_dtype(device_); }
int64_t FluxPromptEncoder::text_dim() const { return models_->t5->config().d_model; }
int64_t FluxPromptEncoder::pooled_dim() const { return models_->clip_config.hidden_size; }

void FluxPromptEncoder::encode(const std::vector<std::string>& captions, const Tensor& text, const Tensor& pooled) {
  const int64_t n = static_cast<int64_t>(captions.size());
  const Shape text_shape{n, text_tokens_, text_dim()}, pooled_shape{n, pooled_dim()};
  const DType dtype = this->dtype();
  const auto in_place = [&](const Tensor& t) { return t.device() == device_ && t.dtype() == dtype; };
  const auto on_host = [](const Tensor& t) { return t.device() == Device::CPU && t.dtype() == DType::F32; };
  for (const auto& [t, shape, what] : {std::tuple{&text, text_shape, "text"}, {&pooled, pooled_shape, "pooled"}})
    if (!((in_place(*t) || on_host(*t)) && t->shape() == shape))
      FORGE_FAIL("FLUX prompts: {} must be {} {} on {} or fp32 on the CPU, got {} {} on {}", what, dtype_name(dtype),
                 shape_str(shape), device_name(device_), dtype_name(t->dtype()), shape_str(t->shape()),
                 device_name(t->device()));
  if (n == 0) return;

  // T5, the captions in one batch; their ids tokenized in parallel.
  const Tensor ids = Tensor::empty({n, text_tokens_}, DType::I32);
  parallel_for(n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const std::vector<int32_t> row =
          models_->t5_tokenizer.prompt_ids(captions[static_cast<size_t>(i)], text_tokens_);
      std::copy(row.begin(), row.end(), ids.data<int32_t>() + i * text_tokens_);
    }
  });
  const Tensor text_out = in_place(text) ? text : Tensor::empty(text_shape, dtype, device_);
  models_->t5_encoder->forward(ids, text_out);
  if (!in_place(text)) copy_converted(text, text_out);

  // CLIP, the captions in one batch.
  std::unique_ptr<ClipTextEncoder>& clip = models_->clip_encoders[n];
  if (!clip) clip = std::make_unique<ClipTextEncoder>(models_->clip_config, n, kClipTokens, device_);
  const std::vector<int32_t> clip_ids = models_->clip_tokenizer.encode_padded_batch(captions, kClipTokens);
  const Tensor hidden = Tensor::empty({n, kClipTokens, pooled_dim()}, dtype, device_);
  const Tensor pooled_out = in_place(pooled) ? pooled : Tensor::empty(pooled_shape, dtype, device_);
  clip->forward(clip_ids, *models_->clip, hidden, pooled_out);
  if (!in_place(pooled)) copy_converted(pooled, pooled_out);
}

}  // namespace forge
