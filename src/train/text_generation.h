// Generation with a KV cache: the prompt is run once (prefill), then one token per step
// (NOTE [Incremental decoding] in model/incremental_decoder.h), each chosen from the last
// position's logits by a TokenSampler, until a stop token or max_new_tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/incremental_decoder.h"
#include "model/parameters.h"
#include "train/token_sampler.h"

namespace forge {

struct GenerationOptions {
  int64_t max_new_tokens = 128;
  SamplingOptions sampling;
  std::vector<int32_t> stop_ids;  // generation ends after the first of these (EOS ids)
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // the new tokens, the stop token included when one ended it
  bool stopped = false;         // at a stop token (else at max_new_tokens)
  double prefill_seconds = 0.0, decode_seconds = 0.0;
};

// Generates after `prompt` (non-empty ids below the model's vocab size) with the decoder
// (whose capacity must hold prompt + max_new_tokens positions; it is reset first).
// on_token(new tokens so far) is called after every token, for streaming.
GenerationResult generate_tokens(IncrementalDecoder& decoder, ParamSource& weights, const std::vector<int32_t>& prompt,
                                 const GenerationOptions& options,
                                 const std::function<void(const std::vector<int32_t>&)>& on_token = {});

}  // namespace forge
