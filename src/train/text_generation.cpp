#include "train/text_generation.h"

#include <algorithm>
#include <chrono>

#include "core/bf16.h"

namespace forge {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The logits row [1, V] in the compute dtype on the device, as fp32 on the host.
std::vector<float> host_logits(const Tensor& logits) {
  const Tensor host = logits.to(Device::CPU);
  std::vector<float> out(static_cast<size_t>(host.numel()));
  if (host.dtype() == DType::F32) {
    std::copy_n(host.data<float>(), out.size(), out.begin());
  } else {
    FORGE_CHECK(host.dtype() == DType::BF16, "logits in {}", dtype_name(host.dtype()));
    const BFloat16* p = host.data<BFloat16>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = to_float(p[i]);
  }
  return out;
}

}  // namespace

GenerationResult generate_tokens(IncrementalDecoder& decoder, ParamSource& weights, const std::vector<int32_t>& prompt,
                                 const GenerationOptions& options,
                                 const std::function<void(const std::vector<int32_t>&)>& on_token) {
  const ModelConfig& config = decoder.config();
  FORGE_CHECK(!prompt.empty(), "generation needs a prompt of at least one token");
  FORGE_CHECK(options.max_new_tokens >= 1, "max_new_tokens {}", options.max_new_tokens);
  for (int32_t id : prompt)
    FORGE_CHECK(id >= 0 && id < config.vocab_size, "prompt token {} outside the model's vocabulary of {}", id,
                config.vocab_size);
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_new_tokens;
  FORGE_CHECK(total - 1 <= decoder.capacity(), "{} prompt + {} new tokens exceed the KV cache's {} positions",
              prompt.size(), options.max_new_tokens, decoder.capacity());
  TokenSampler sampler(options.sampling);
  decoder.reset();
  const Device device = decoder.device();
  Tensor logits = Tensor::empty({1, config.vocab_size}, decoder.compute_dtype(), device);
  GenerationResult result;

  auto t0 = std::chrono::steady_clock::now();
  Tensor prompt_ids = Tensor::empty({static_cast<int64_t>(prompt.size())}, DType::I32);
  std::copy(prompt.begin(), prompt.end(), prompt_ids.data<int32_t>());
  decoder.forward(prompt_ids.to(device), weights, logits);
  std::vector<float> row = host_logits(logits);
  result.prefill_seconds = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  Tensor next = Tensor::empty({1}, DType::I32), next_on_device = Tensor::empty({1}, DType::I32, device);
  while (true) {
    const int32_t token = sampler.next(row);
    result.tokens.push_back(token);
    if (on_token) on_token(result.tokens);
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) != options.stop_ids.end()) {
      result.stopped = true;
      break;
    }
    if (static_cast<int64_t>(result.tokens.size()) == options.max_new_tokens) break;
    next.data<int32_t>()[0] = token;
    next_on_device.copy_from(next);
    decoder.forward(next_on_device, weights, logits);
    row = host_logits(logits);
  }
  result.decode_seconds = seconds_since(t0);
  return result;
}

}  // namespace forge
