// SftEncoder, tokenize_rendered and fit_to_seq_len; see sft_tokenize.h.
#include "data/sft_tokenize.h"

#include <algorithm>

#include "core/error.h"

namespace forge {

namespace {

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

// The token index where text offset `offset` falls (NOTE [Response tokens from text
// spans]); a straddling token goes to the response side: after it for an end boundary.
size_t token_boundary(const Tokenizer& tokenizer, std::string_view text, const std::vector<int32_t>& ids,
                      size_t offset, bool span_end) {
  if (offset == 0) return 0;
  if (offset >= text.size()) return ids.size();
  const std::vector<int32_t> prefix = tokenizer.encode(text.substr(0, offset));
  const size_t common = common_prefix(prefix, ids);
  if (common == prefix.size()) return common;
  return span_end ? std::min(common + 1, ids.size()) : common;
}

}  // namespace

SftTokens tokenize_rendered(const Tokenizer& tokenizer, const RenderedText& rendered) {
  SftTokens out;
  out.ids = tokenizer.encode(rendered.text);
  out.mask.assign(out.ids.size(), 0);
  for (const auto& [begin, end] : rendered.response_spans) {
    if (begin >= end) continue;
    const size_t first = token_boundary(tokenizer, rendered.text, out.ids, begin, false);
    const size_t last = token_boundary(tokenizer, rendered.text, out.ids, end, true);
    for (size_t i = first; i < last; ++i) out.mask[i] = 1;
  }
  return out;
}

bool prepend_bos_once(std::vector<int32_t>& ids, int32_t bos, std::vector<uint8_t>* mask) {
  if (!ids.empty() && ids.front() == bos) return false;
  ids.insert(ids.begin(), bos);
  if (mask) mask->insert(mask->begin(), 0);
  return true;
}

SftEncoder::SftEncoder(const Tokenizer& tokenizer, SftEncoderOptions options)
    : tokenizer_(tokenizer), options_(std::move(options)) {
  if (options_.prepend_bos && !tokenizer_.bos_id())
    FORGE_FAIL("--prepend-bos: the tokenizer defines no BOS token");
  if (!options_.chat_template) {
    if (!tokenizer_.eos_id())
      FORGE_FAIL("the tokenizer defines no EOS token, which ends every completion when no chat template is used: "
                 "give --chat-template or use a tokenizer with an EOS token");
    return;
  }
  for (const std::string& token : template_special_tokens(*options_.chat_template, options_.special_tokens)) {
    const std::vector<int32_t> ids = tokenizer_.encode(token);
    if (ids.size() != 1)
      FORGE_FAIL("the {} chat template writes \"{}\", which this tokenizer encodes as {} tokens, not as one special "
                 "token: is it the model's tokenizer?",
                 chat_template_name(*options_.chat_template), token, ids.size());
  }
}

RenderedText SftEncoder::render(const SftExample& example) const {
  if (example.shape == SftShape::Messages) {
    if (!options_.chat_template)
      FORGE_FAIL("a \"messages\" example needs a chat template: give --chat-template llama3|llama2|mistral, or a "
                 "tokenizer directory whose tokenizer_config.json has one of those");
    return render_chat(*options_.chat_template, example.messages, options_.special_tokens, options_.train_on);
  }
  if (options_.chat_template) {
    const std::vector<ChatMessage> turn = {{ChatRole::User, example.prompt}, {ChatRole::Assistant, example.completion}};
    return render_chat(*options_.chat_template, turn, options_.special_tokens, options_.train_on);
  }
  RenderedText rendered;
  rendered.text = example.prompt + example.completion;
  rendered.response_spans.emplace_back(example.prompt.size(), rendered.text.size());
  return rendered;
}

SftTokens SftEncoder::encode(const SftExample& example) const {
  SftTokens tokens = tokenize_rendered(tokenizer_, render(example));
  if (!options_.chat_template) {
    tokens.ids.push_back(*tokenizer_.eos_id());
    tokens.mask.push_back(1);
  }
  if (options_.prepend_bos) prepend_bos_once(tokens.ids, *tokenizer_.bos_id(), &tokens.mask);
  return tokens;
}

SeqLenFit fit_to_seq_len(SftTokens& tokens, int64_t seq_len, Overlong overlong) {
  SeqLenFit fit = SeqLenFit::Fits;
  if (seq_len > 0 && static_cast<int64_t>(tokens.ids.size()) > seq_len + 1) {
    if (overlong == Overlong::Drop) return SeqLenFit::DroppedOverlong;
    tokens.ids.resize(static_cast<size_t>(seq_len) + 1);
    tokens.mask.resize(static_cast<size_t>(seq_len) + 1);
    fit = SeqLenFit::Truncated;
  }
  if (std::find(tokens.mask.begin(), tokens.mask.end(), 1) == tokens.mask.end()) return SeqLenFit::DroppedNoResponse;
  return fit;
}

}  // namespace forge
