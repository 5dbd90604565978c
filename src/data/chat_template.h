// Chat templates, built in: the text a model's Hugging Face chat template renders for a
// list of messages (transformers' apply_chat_template(messages, tokenize=False)), with
// the spans of that text that are the assistant's responses, for the loss mask. No Jinja
// engine: each supported template is written out here, byte for byte what its Jinja
// source renders (tests/python/test_sft_prep_vs_hf.py checks it token for token).
//
//   llama3   Llama 3.1 / 3.3 Instruct (meta-llama/Llama-3.1-8B-Instruct,
//            Llama-3.3-70B-Instruct share it): BOS, then always a system turn
//            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" + the
//            (trimmed) system message, then every message as
//            <|start_header_id|>ROLE<|end_header_id|>\n\n + trim(content) + <|eot_id|>.
//            No tools (tool and ipython roles are refused).
//   llama2   Llama 2 Chat (meta-llama/Llama-2-7b-chat-hf): optional system message
//            folded into the first user turn as "<<SYS>>\n...\n<</SYS>>\n\n"; user turns
//            BOS + "[INST] " + strip(content) + " [/INST]"; assistant turns
//            " " + strip(content) + " " + EOS. Roles must alternate user/assistant.
//   mistral  Mistral / Mixtral Instruct v0.1 (mistralai/Mixtral-8x7B-Instruct-v0.1):
//            BOS, then user turns "[INST] " + content + " [/INST]" and assistant turns
//            content + EOS, unstripped. No system message; roles alternate.
// trim / strip remove leading and trailing whitespace as Python's str.strip() does
// (Unicode whitespace included). What the templates refuse (roles out of order, a system
// message where none is allowed) is an error here too, naming the message.
//
// Response spans: each assistant message's rendered content and its end-of-turn text
// (llama3: trim(content) + <|eot_id|>; llama2: " " + strip(content) + " " + EOS;
// mistral: content + EOS), for every assistant message (TrainOn::AllAssistantTurns, as
// transformers' return_assistant_tokens_mask and torchtune do) or only the last one.
//
// NOTE [Recognizing a chat template]
// `--chat-template auto` reads "chat_template" from tokenizer_config.json beside the
// tokenizer and compares it with the official sources of the three templates above after
// normalizing whitespace: inside Jinja tags ({{ }}, {% %}, {# #}) whitespace outside
// string literals is dropped, and so is text between tags that is only whitespace; string
// literals and other text must match exactly. So a re-indented or re-wrapped copy of an
// official template is recognized, while one that changes what is rendered (a literal, a
// condition, a role) is not, and is refused naming the templates forge supports.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/sft_example.h"

namespace forge {

enum class ChatTemplate { Llama3, Llama2, Mistral };

std::string_view chat_template_name(ChatTemplate chat_template);
// "llama3" / "llama2" / "mistral"; empty when the name is none of them.
std::optional<ChatTemplate> chat_template_from_name(std::string_view name);
// The official Jinja source of the template (as in the model's tokenizer_config.json).
std::string_view chat_template_source(ChatTemplate chat_template);
// The template whose official source `jinja` is (NOTE [Recognizing a chat template]).
std::optional<ChatTemplate> recognize_chat_template(std::string_view jinja);
// The normalized form NOTE [Recognizing a chat template] compares.
std::string normalize_chat_template(std::string_view jinja);

// Text of the special tokens a template writes as text (tokenizer_config.json's
// bos_token / eos_token where there is one, else the model family's own).
struct ChatSpecialTokens {
  std::string bos, eos;
};
ChatSpecialTokens default_special_tokens(ChatTemplate chat_template);
// Every special token's text that the template writes (for checking the tokenizer has them).
std::vector<std::string> template_special_tokens(ChatTemplate chat_template, const ChatSpecialTokens& tokens);

enum class TrainOn { AllAssistantTurns, LastAssistantTurn };

struct RenderedText {
  std::string text;
  std::vector<std::pair<size_t, size_t>> response_spans;  // [begin, end) byte offsets, ascending
};

// The text of `messages`; throws naming the message the template refuses, or when there
// is no assistant message (nothing to train on).
RenderedText render_chat(ChatTemplate chat_template, const std::vector<ChatMessage>& messages,
                         const ChatSpecialTokens& tokens, TrainOn train_on);

// Python's str.strip(): leading and trailing Unicode whitespace (str.isspace) removed.
std::string python_strip(std::string_view text);

}  // namespace forge
