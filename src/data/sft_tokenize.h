// Instruction examples (sft_example.h) to token ids and a loss mask: 1 where the token is
// part of the response (its prediction is trained on), 0 for prompt, system and template
// tokens.
//
// Rendering. Chat messages go through the chat template (chat_template.h). A prompt /
// completion pair (and an Alpaca example, whose prompt is the Alpaca template) becomes,
// with a chat template, one user turn (the prompt) and one assistant turn (the
// completion); without one, the text prompt + completion (concatenated, nothing between)
// followed by the tokenizer's EOS id, the completion and the EOS being the response.
//
// NOTE [Response tokens from text spans]
// The rendered text is tokenized whole, exactly as transformers' apply_chat_template(
// tokenize=True) tokenizes it, so the ids equal the reference's. Which tokens are the
// response is decided from the text: for each response span [b, e) the tokens of
// text[0, b) and text[0, e) are compared with the whole text's; where the prefix's tokens
// are a prefix of the whole's (the usual case: templates put special tokens or
// whitespace there), its length is the boundary. Where a token straddles a boundary (the
// tokenizer merged text across it), the straddling token counts as response, as
// transformers' return_assistant_tokens_mask counts any token holding a response
// character. This costs one extra tokenization of a prefix per boundary.
//
// --prepend-bos adds the tokenizer's BOS id in front of every example (mask 0) unless
// its tokens already start with BOS (the llama3, llama2 and mistral templates write the
// BOS text themselves, which tokenizes to the BOS id), so BOS is never doubled.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "data/chat_template.h"
#include "data/sft_example.h"
#include "data/tokenizer.h"

namespace forge {

struct SftTokens {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;  // same length as ids
};

struct SftEncoderOptions {
  std::optional<ChatTemplate> chat_template;  // none: prompt + completion + EOS; chat lines refused
  ChatSpecialTokens special_tokens;           // texts the template writes for BOS / EOS
  TrainOn train_on = TrainOn::AllAssistantTurns;
  bool prepend_bos = false;
};

// Ids and mask of `rendered`, per NOTE [Response tokens from text spans].
SftTokens tokenize_rendered(const Tokenizer& tokenizer, const RenderedText& rendered);

// Puts `bos` in front of `ids` (and 0 in front of `mask` when given) unless ids starts
// with it; returns whether it did.
bool prepend_bos_once(std::vector<int32_t>& ids, int32_t bos, std::vector<uint8_t>* mask = nullptr);

class SftEncoder {
 public:
  // Checks that the tokenizer has what the options need: an EOS id without a chat
  // template, a BOS id for prepend_bos, and each special token the template writes as
  // one token.
  SftEncoder(const Tokenizer& tokenizer, SftEncoderOptions options);

  RenderedText render(const SftExample& example) const;
  SftTokens encode(const SftExample& example) const;
  // parse_sft_line + encode; throws with the reason (the caller adds file:line).
  SftTokens encode_line(std::string_view line) const { return encode(parse_sft_line(line)); }

 private:
  const Tokenizer& tokenizer_;
  SftEncoderOptions options_;
};

enum class Overlong { Truncate, Drop };
enum class SeqLenFit { Fits, Truncated, DroppedOverlong, DroppedNoResponse };

// A training sample is seq_len + 1 tokens (inputs and shifted targets), so an example
// fits when it has at most seq_len + 1 tokens. An overlong one is cut to seq_len + 1
// tokens (Truncate) or dropped (Drop); one whose mask has no 1 left after cutting is
// dropped (DroppedNoResponse). seq_len 0: no limit.
SeqLenFit fit_to_seq_len(SftTokens& tokens, int64_t seq_len, Overlong overlong);

}  // namespace forge
