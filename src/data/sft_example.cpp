// parse_sft_line and alpaca_prompt; see sft_example.h.
#include "data/sft_example.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_input.h"

namespace forge {

namespace {

using nlohmann::json;

const char* json_type(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "a list";
    case json::value_t::object: return "an object";
    default: return "a number";
  }
}

// The string under `key` of `object`; `field` names it in errors.
std::string required_string(const json& object, const char* key, const std::string& field) {
  const auto it = object.find(key);
  if (it == object.end()) FORGE_FAIL("{} is missing", field);
  if (!it->is_string()) FORGE_FAIL("{} is {}, expected a string", field, json_type(*it));
  return it->get<std::string>();
}

ChatRole parse_role(const std::string& role, const std::string& field) {
  if (role == "system") return ChatRole::System;
  if (role == "user") return ChatRole::User;
  if (role == "assistant") return ChatRole::Assistant;
  FORGE_FAIL("{} is {}: expected \"system\", \"user\" or \"assistant\"", field, describe_json(json(role)));
}

std::vector<ChatMessage> parse_messages(const json& messages) {
  if (!messages.is_array()) FORGE_FAIL("\"messages\" is {}, expected a list of messages", json_type(messages));
  if (messages.empty()) FORGE_FAIL("\"messages\" is an empty list");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& message = messages[i];
    const std::string field = fmt::format("messages[{}]", i);
    if (!message.is_object())
      FORGE_FAIL("{} is {}, expected an object with \"role\" and \"content\"", field, json_type(message));
    ChatMessage parsed;
    parsed.role = parse_role(required_string(message, "role", field + ".role"), field + ".role");
    parsed.content = required_string(message, "content", field + ".content");
    out.push_back(std::move(parsed));
  }
  return out;
}

}  // namespace

std::string_view chat_role_name(ChatRole role) {
  switch (role) {
    case ChatRole::System: return "system";
    case ChatRole::User: return "user";
    case ChatRole::Assistant: return "assistant";
  }
  return "?";
}

std::string alpaca_prompt(std::string_view instruction, std::string_view input) {
  if (input.empty())
    return fmt::format("Below is an instruction that describes a task. Write a response that appropriately completes "
                       "the request.\n\n### Instruction:\n{}\n\n### Response:\n",
                       instruction);
  return fmt::format("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n### Instruction:\n{}"
                     "\n\n### Input:\n{}\n\n### Response:\n",
                     instruction, input);
}

SftExample parse_sft_line(std::string_view line) {
  const json value = parse_json(line, "the line");
  if (!value.is_object()) FORGE_FAIL("the line is {}, expected a JSON object", json_type(value));
  const bool chat = value.contains("messages");
  const bool prompt_completion = value.contains("prompt") || value.contains("completion");
  const bool alpaca = value.contains("instruction") || value.contains("output");
  if (chat + prompt_completion + alpaca > 1)
    FORGE_FAIL("the line mixes shapes (keys of {}{}{}): give \"messages\", or \"prompt\" and \"completion\", or "
               "Alpaca's \"instruction\", \"input\" and \"output\"",
               chat ? "\"messages\" " : "", prompt_completion ? "\"prompt\"/\"completion\" " : "",
               alpaca ? "\"instruction\"/\"output\"" : "");
  SftExample example;
  if (chat) {
    example.shape = SftShape::Messages;
    example.messages = parse_messages(value["messages"]);
  } else if (prompt_completion) {
    example.shape = SftShape::PromptCompletion;
    example.prompt = required_string(value, "prompt", "\"prompt\"");
    example.completion = required_string(value, "completion", "\"completion\"");
  } else if (alpaca) {
    example.shape = SftShape::Alpaca;
    std::string input;
    const auto it = value.find("input");
    if (it != value.end() && !it->is_null()) {
      if (!it->is_string()) FORGE_FAIL("\"input\" is {}, expected a string (or null, or no \"input\")", json_type(*it));
      input = it->get<std::string>();
    }
    example.prompt = alpaca_prompt(required_string(value, "instruction", "\"instruction\""), input);
    example.completion = required_string(value, "output", "\"output\"");
  } else {
    FORGE_FAIL("no known keys: expected \"messages\" (chat), \"prompt\" and \"completion\", or Alpaca's "
               "\"instruction\" and \"output\"");
  }
  return example;
}

}  // namespace forge
