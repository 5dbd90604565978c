// One instruction-tuning example read from one JSON Lines line, in the three shapes
// instruction data comes in (`forge prep --format sft`):
//
//   {"prompt": "...", "completion": "..."}                  prompt / completion
//   {"instruction": "...", "input": "...", "output": "..."}  Alpaca ("input" optional)
//   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}  chat
//
// The shape is chosen by the keys present (keys of two shapes in one line are an error);
// other keys ("id", "source", ...) are ignored. An Alpaca example becomes a
// prompt/completion pair whose prompt is the Stanford Alpaca template (alpaca_prompt
// below) and whose completion is "output"; its "input" may be missing, null or "" (no
// input). Rendering the example into text is sft_tokenize.h's and chat_template.h's; this
// file only reads and checks.
//
// The line is parsed as RFC 8259 JSON (nlohmann, bounded: NOTE [Bounded JSON input]);
// Python's extensions that `--format text` accepts (NaN, lone surrogates: NOTE [Python's
// JSON]) are errors here. Every error names the field: "messages[2].role is \"tool\":
// expected \"system\", \"user\" or \"assistant\"".
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace forge {

enum class ChatRole { System, User, Assistant };

std::string_view chat_role_name(ChatRole role);

struct ChatMessage {
  ChatRole role = ChatRole::User;
  std::string content;
};

enum class SftShape { PromptCompletion, Alpaca, Messages };

struct SftExample {
  SftShape shape = SftShape::PromptCompletion;
  std::string prompt, completion;     // PromptCompletion and Alpaca (prompt already templated)
  std::vector<ChatMessage> messages;  // Messages: at least one, as given
};

// Parses one line; throws forge::Error with the reason (the caller adds file:line).
SftExample parse_sft_line(std::string_view line);

// The Stanford Alpaca prompt (github.com/tatsu-lab/stanford_alpaca, train.py
// PROMPT_DICT): with a non-empty input
//   "Below is an instruction that describes a task, paired with an input that provides
//   further context. Write a response that appropriately completes the request.\n\n
//   ### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
// and without one
//   "Below is an instruction that describes a task. Write a response that appropriately
//   completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
std::string alpaca_prompt(std::string_view instruction, std::string_view input);

}  // namespace forge
