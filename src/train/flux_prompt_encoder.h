// FluxPromptEncoder: captions to the two text conditions a FLUX transformer reads, as
// diffusers' FluxPipeline.encode_prompt computes them, for `forge sample` and `forge prep
// --images`.
//
// NOTE [FLUX prompt encoding]
// Per caption (FluxPipeline._get_t5_prompt_embeds and _get_clip_prompt_embeds):
//   text    T5's encoder output [text_tokens, d_model] over the caption's ids tokenized by
//           tokenizer_2 to exactly text_tokens ids (512 by default: max_sequence_length;
//           truncated keeping </s>, padded with <pad>; NOTE [T5 prompt tokens]), no attention
//           mask (the padding is attended to);
//   pooled  CLIP's pooler_output [hidden] over the caption tokenized by tokenizer to 77 ids
//           (tokenizer_max_length; NOTE [CLIP tokenizer]), no attention mask.
// The encoders run on the CPU in fp32 or on CUDA in bf16 (NOTE [T5 precision]), over the
// captions of one encode() call as one batch each (T5's dense attention scores grow with
// the batch: callers pass batches of the size they can afford); the T5 ids are tokenized
// in parallel (core/parallel.h). The results are written either where the encoders compute
// them (dtype() on device(), what `forge prep --images` stores) or into fp32 host tensors
// (what `forge sample` hands the denoiser). Every small file (the tokenizers, both
// configs) is read and checked against the others (each tokenizer's vocabulary fits its
// encoder's embeddings, CLIP has the 77 positions) before any weight loads; errors name
// the file and the flag that gave it. It lives in train/ rather than model/ because it loads
// weights (ckpt/) and tokenizers (data/), which model/ may not include (ARCHITECTURE.md's
// layers, python.test_include_graph).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace forge {

struct FluxPromptFiles {
  // T5: a T5EncoderModel folder or the pipeline folder holding text_encoder_2/ (NOTE [T5
  // weight files]); its tokenizer: spiece.model, tokenizer.json, a folder with one, or the
  // pipeline folder holding tokenizer_2/.
  std::string t5, t5_tokenizer;
  // CLIP: a CLIPTextModel folder, the pipeline folder holding text_encoder/, or a
  // .safetensors file (NOTE [CLIP text weight files]); its tokenizer: a CLIP tokenizer folder
  // or the pipeline folder holding tokenizer/.
  std::string clip, clip_tokenizer;
  // What gave each path, for errors: the command-line flags of `forge prep --images` and
  // `forge sample` by default.
  std::string t5_flag = "--t5", t5_tokenizer_flag = "--t5-tokenizer", clip_flag = "--clip",
              clip_tokenizer_flag = "--clip-tokenizer";
};

class FluxPromptEncoder {
 public:
  static constexpr int64_t kClipTokens = 77;  // FluxPipeline's tokenizer_max_length

  // Loads both tokenizers and configs, checks them, then both encoders' weights (every file
  // checked, errors name it and its flag); text_tokens is T5's sequence length
  // (FluxPipeline's max_sequence_length), >= 1.
  FluxPromptEncoder(const FluxPromptFiles& files, Device device, int64_t text_tokens = 512);
  ~FluxPromptEncoder();

  int64_t text_tokens() const { return text_tokens_; }
  Device device() const { return device_; }
  DType dtype() const;  // the encoders' compute dtype: fp32 on the CPU, bf16 on CUDA
  int64_t text_dim() const;    // T5's d_model (the transformer's context_dim)
  int64_t pooled_dim() const;  // CLIP's hidden size (the transformer's pooled_dim)

  // text [N, text_tokens, text_dim] and pooled [N, pooled_dim] for the N captions, as one
  // batch (NOTE [FLUX prompt encoding]). Each output is either dtype() on device() (written
  // in place) or fp32 on the CPU (converted into).
  void encode(const std::vector<std::string>& captions, const Tensor& text, const Tensor& pooled);

  struct Models;  // flux_prompt_encoder.cpp

 private:
  std::unique_ptr<Models> models_;
  Device device_;
  int64_t text_tokens_;
};

}  // namespace forge
