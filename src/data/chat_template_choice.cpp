// choose_chat_template; see chat_template_choice.h.
#include "data/chat_template_choice.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_input.h"

namespace forge {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kSupported =
    "forge renders llama3 (Llama 3.1 / 3.3 Instruct), llama2 (Llama 2 Chat) and mistral (Mistral / Mixtral "
    "Instruct v0.1): give --chat-template llama3|llama2|mistral if the model uses one of them, or --chat-template "
    "none for prompt/completion data without a template";

std::string config_path_beside(const std::string& tokenizer_path) {
  const fs::path path(tokenizer_path);
  const fs::path directory = fs::is_directory(path) ? path : path.parent_path();
  return (directory / "tokenizer_config.json").string();
}

// tokenizer_config.json's bos_token / eos_token: a string or an AddedToken object.
std::optional<std::string> token_text(const json& config, const char* key, const std::string& file) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  FORGE_FAIL("{}: \"{}\" is {}, expected a string or an object with \"content\"", file, key, describe_json(*it));
}

// The "chat_template" source: a string, or a list of {"name", "template"} whose "default" is used.
std::optional<std::string> template_source(const json& config, const std::string& file) {
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const json& entry : *it)
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string())
        return entry["template"].get<std::string>();
    FORGE_FAIL("{}: \"chat_template\" is a list without a template named \"default\"; {}", file, kSupported);
  }
  FORGE_FAIL("{}: \"chat_template\" is {}, expected a string", file, describe_json(*it));
}

}  // namespace

ChatTemplateChoice choose_chat_template(std::string_view option, const std::string& tokenizer_path) {
  ChatTemplateChoice choice;
  if (option == "none") {
    choice.origin = "--chat-template none";
    return choice;
  }
  const std::optional<ChatTemplate> named = chat_template_from_name(option);
  if (!option.empty() && option != "auto" && !named)
    FORGE_FAIL("--chat-template '{}': expected llama3, llama2, mistral, auto or none", option);

  const std::string file = config_path_beside(tokenizer_path);
  std::error_code error;
  const bool have_config = fs::exists(file, error);
  json config = json::object();
  if (have_config) config = read_json_file(file, "the tokenizer_config.json");
  if (!config.is_object()) FORGE_FAIL("{}: expected a JSON object", file);

  if (named) {
    choice.chat_template = named;
    choice.origin = fmt::format("--chat-template {}", option);
  } else {
    const std::optional<std::string> source = have_config ? template_source(config, file) : std::nullopt;
    if (!source) {
      if (option.empty()) {
        choice.origin = have_config ? fmt::format("none ({} has no chat_template)", file)
                                    : fmt::format("none (no {})", file);
        return choice;
      }
      FORGE_FAIL("--chat-template auto: {} {}; {}", file, have_config ? "has no \"chat_template\"" : "not found",
                 kSupported);
    }
    choice.chat_template = recognize_chat_template(*source);
    if (!choice.chat_template)
      FORGE_FAIL("{}: its \"chat_template\" is none of the templates forge renders without a Jinja engine "
                 "(compared after whitespace normalization); {}",
                 file, kSupported);
    choice.origin = fmt::format("{} (recognized as {})", file, chat_template_name(*choice.chat_template));
  }
  choice.special_tokens = default_special_tokens(*choice.chat_template);
  if (have_config) {
    if (auto bos = token_text(config, "bos_token", file)) choice.special_tokens.bos = *bos;
    if (auto eos = token_text(config, "eos_token", file)) choice.special_tokens.eos = *eos;
  }
  return choice;
}

}  // namespace forge
