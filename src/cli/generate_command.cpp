// forge generate: text from a model (NOTE [Model sources]) and a prompt, through the
// tokenizer, with a KV cache (NOTE [Incremental decoding]), streamed to stdout.
//
// Only the generated text goes to stdout (the prompt is not echoed), so it can be piped;
// progress and the summary go to stderr. The prompt is --prompt-file's text followed by
// --prompt's; the tokenizer's BOS is put first when it has one that is not also its EOS
// (as Hugging Face's Llama and Mistral tokenizers do; GPT-2-style ones have no separate
// BOS), unless --no-bos. Generation stops after max_new_tokens or at a stop token: the
// tokenizer's EOS and, for a Hugging Face folder, generation_config.json's eos_token_id
// (one id or a list), unless --ignore-eos; the stop token itself is not printed.
// --adapter merges a PEFT adapter into the model; a LoRA run directory as --model brings
// its base (whose tokenizer is used) and adapter itself (cli/inference_model.h).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/inference_model.h"
#include "cli/commands.h"
#include "core/device.h"
#include "core/durable_file.h"
#include "core/json_input.h"
#include "core/log.h"
#include "data/tokenizer.h"
#include "model/incremental_decoder.h"
#include "train/text_generation.h"

namespace forge {
namespace {

std::string read_prompt_file(const std::string& path) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) FORGE_FAIL("--prompt-file '{}' is not a readable file", path);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in && !in.eof()) FORGE_FAIL("--prompt-file '{}' could not be read", path);
  return text.str();
}

// generation_config.json's eos_token_id: an id or a list of ids.
std::vector<int32_t> generation_config_eos(const std::string& hf_dir) {
  const std::filesystem::path path = std::filesystem::path(hf_dir) / "generation_config.json";
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) return {};
  const nlohmann::json config = read_json_file(path.string(), "generation_config.json");
  if (!config.is_object() || !config.contains("eos_token_id") || config["eos_token_id"].is_null()) return {};
  const nlohmann::json& eos = config["eos_token_id"];
  std::vector<int32_t> ids;
  auto take = [&](const nlohmann::json& id) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      FORGE_FAIL("{}: eos_token_id: expected a token id or a list of them, got {}", path.string(), id.dump());
    ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  };
  if (eos.is_array()) {
    for (const auto& id : eos) take(id);
  } else {
    take(eos);
  }
  return ids;
}

// Streams the text of the tokens generated so far: the decode of prompt + new tokens past
// the prompt's own decode (so tokenizers whose decoders treat the first token specially
// print what they would print in context), holding back a trailing incomplete UTF-8
// character (U+FFFD) until the next token completes it.
class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<int32_t> prompt)
      : tokenizer_(tokenizer), prompt_(std::move(prompt)), prompt_text_(tokenizer.decode(prompt_)) {}

  void update(const std::vector<int32_t>& generated, bool final) {
    std::vector<int32_t> all = prompt_;
    all.insert(all.end(), generated.begin(), generated.end());
    const std::string text = tokenizer_.decode(all);
    if (!text.starts_with(prompt_text_)) return;  // the decoder rewrote the prompt's text: nothing safe to add
    std::string fresh = text.substr(prompt_text_.size());
    if (!final && fresh.ends_with("\xEF\xBF\xBD")) return;
    if (fresh.size() > printed_.size() && fresh.starts_with(printed_)) {
      std::fwrite(fresh.data() + printed_.size(), 1, fresh.size() - printed_.size(), stdout);
      std::fflush(stdout);
      printed_ = fresh;
    }
  }
  const std::string& text() const { return printed_; }

 private:
  const Tokenizer& tokenizer_;
  std::vector<int32_t> prompt_;
  std::string prompt_text_, printed_;
};

}  // namespace

int run_generate(const GenerateOptions& o) {
  validate_sampling(o.sampling);
  if (o.max_new_tokens < 1) FORGE_FAIL("--max-new-tokens {}: expected an integer >= 1", o.max_new_tokens);
  if (o.device != "cpu" && o.device != "cuda") FORGE_FAIL("--device '{}': expected cpu or cuda", o.device);
  std::string prompt_text = o.prompt_file.empty() ? std::string() : read_prompt_file(o.prompt_file);
  prompt_text += o.prompt;
  if (prompt_text.empty())
    FORGE_FAIL("the prompt is empty: give --prompt TEXT and/or --prompt-file FILE with some text");
  const Device device = o.device == "cuda" ? Device::CUDA : Device::CPU;
  if (device == Device::CUDA && !cuda_available())
    FORGE_FAIL("--device cuda: no GPU is visible, or this build of forge has no CUDA backend");

  set_log_level(LogLevel::Warn);  // stdout carries the generated text alone
  LoadedModel model = load_inference_model(o.model, o.adapter);
  const std::string tokenizer_path = !o.tokenizer.empty() ? o.tokenizer : model.hf_dir;
  if (tokenizer_path.empty())
    FORGE_FAIL("{} has no tokenizer of its own: give --tokenizer (tokenizer.json, tokenizer.model or a folder "
               "holding one)",
               model.description);
  std::unique_ptr<Tokenizer> tokenizer;
  try {
    tokenizer = load_tokenizer(tokenizer_path);
  } catch (const Error& e) {
    if (!o.tokenizer.empty()) throw;
    FORGE_FAIL("{} (the tokenizer of {}; give --tokenizer to use another)", e.what(), model.description);
  }
  const int64_t vocab = model.config.vocab_size;
  if (tokenizer->vocab_size() > vocab)
    FORGE_FAIL("tokenizer '{}' has {} tokens but the model's vocabulary is {} ({}): they do not belong together",
               tokenizer_path, tokenizer->vocab_size(), vocab, model.description);

  std::vector<int32_t> prompt;
  const std::optional<int32_t> bos = tokenizer->bos_id(), eos = tokenizer->eos_id();
  if (!o.no_bos && bos && bos != eos) prompt.push_back(*bos);
  const std::vector<int32_t> encoded = tokenizer->encode(prompt_text);
  prompt.insert(prompt.end(), encoded.begin(), encoded.end());
  if (prompt.empty()) FORGE_FAIL("the prompt encodes to no tokens (and the tokenizer has no BOS to start from)");

  GenerationOptions options;
  options.max_new_tokens = o.max_new_tokens;
  options.sampling = o.sampling;
  if (!o.ignore_eos) {
    if (eos) options.stop_ids.push_back(*eos);
    if (!model.hf_dir.empty())
      for (int32_t id : generation_config_eos(model.hf_dir)) options.stop_ids.push_back(id);
    for (int32_t id : options.stop_ids)
      if (id >= vocab) FORGE_FAIL("EOS id {} is outside the model's vocabulary of {}", id, vocab);
  }
  const int64_t positions = static_cast<int64_t>(prompt.size()) + o.max_new_tokens - 1;
  if (positions > model.config.max_seq_len)
    log_warn("{} prompt tokens + {} new tokens reach position {}, beyond the model's max_seq_len {}", prompt.size(),
             o.max_new_tokens, positions, model.config.max_seq_len);
  fmt::print(stderr, "generating with {} on {}: {} prompt tokens, up to {} new ({})\n", model.description, o.device,
             prompt.size(), o.max_new_tokens,
             o.sampling.temperature == 0.0
                 ? std::string("greedy")
                 : fmt::format("temperature {}, top-k {}, top-p {}, seed {}", o.sampling.temperature,
                               o.sampling.top_k, o.sampling.top_p, o.sampling.seed));

  std::unique_ptr<FlatParameters> on_device;
  if (device == Device::CUDA) {
    on_device = std::make_unique<FlatParameters>(model.config, device, DType::BF16);
    on_device->assign_from(*model.params);
  }
  ParamSource& weights = on_device ? *on_device : *model.params;
  IncrementalDecoder decoder(model.config, positions, device, device == Device::CUDA ? DType::BF16 : DType::F32);
  TextStream stream(*tokenizer, prompt);
  const GenerationResult result =
      generate_tokens(decoder, weights, prompt, options, [&](const std::vector<int32_t>& tokens) {
        const bool stop = !options.stop_ids.empty() &&
                          std::find(options.stop_ids.begin(), options.stop_ids.end(), tokens.back()) !=
                              options.stop_ids.end();
        if (!stop) stream.update(tokens, false);
      });
  std::vector<int32_t> text_tokens = result.tokens;
  if (result.stopped) text_tokens.pop_back();
  stream.update(text_tokens, true);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const double steps = static_cast<double>(result.tokens.size()) - 1.0;
  fmt::print(stderr, "{} new tokens ({}); prefill {:.3f} s, {:.1f} tokens/s after it\n", result.tokens.size(),
             result.stopped ? "stopped at EOS" : "max_new_tokens reached", result.prefill_seconds,
             steps > 0 && result.decode_seconds > 0 ? steps / result.decode_seconds : 0.0);
  if (!o.json.empty()) {
    const nlohmann::ordered_json report = {{"model", o.model},
                                           {"adapter", model.adapter_dir},
                                           {"source", model.description},
                                           {"prompt_tokens", prompt},
                                           {"new_tokens", result.tokens},
                                           {"text", stream.text()},
                                           {"stop", result.stopped ? "eos" : "max_new_tokens"},
                                           {"prefill_seconds", result.prefill_seconds},
                                           {"decode_seconds", result.decode_seconds}};
    write_file_atomic(o.json, report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", DurableOptions{});
  }
  return 0;
}

}  // namespace forge
