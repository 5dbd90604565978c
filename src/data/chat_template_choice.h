// Which chat template `forge prep --format sft` renders with (`--chat-template`), and the
// BOS / EOS texts it writes, from the option and the tokenizer_config.json beside the
// tokenizer (in the tokenizer's directory, or the directory of the tokenizer file):
//
//   llama3|llama2|mistral   that template; BOS/EOS texts from tokenizer_config.json's
//                           bos_token/eos_token when it has them, else the family's own
//   auto                    the template of tokenizer_config.json's "chat_template",
//                           recognized as one of those three (NOTE [Recognizing a chat
//                           template]); a missing file or key, or another template, is an
//                           error naming the file and the supported templates
//   none                    no template: prompt + completion + EOS; chat lines refused
//   (not given)             auto when tokenizer_config.json has a "chat_template", else none
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "data/chat_template.h"

namespace forge {

struct ChatTemplateChoice {
  std::optional<ChatTemplate> chat_template;
  ChatSpecialTokens special_tokens;
  std::string origin;  // for the log: "--chat-template llama2", "<dir>/tokenizer_config.json", ...
};

// `option` is the --chat-template value, empty when not given.
ChatTemplateChoice choose_chat_template(std::string_view option, const std::string& tokenizer_path);

}  // namespace forge
