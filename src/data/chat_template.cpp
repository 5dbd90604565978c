// render_chat, recognize_chat_template and their helpers; see chat_template.h. The
// templates' sources are in chat_template_sources.cpp.
#include "data/chat_template.h"

#include "core/error.h"
#include "data/utf8.h"

namespace forge {

namespace {

// Python's str.isspace(): Unicode White_Space plus the separators U+001C..U+001F.
bool python_space(int32_t code_point) {
  return utf8::is_whitespace(code_point) || (code_point >= 0x1C && code_point <= 0x1F);
}

bool space_char(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

constexpr std::string_view kLlama3Header = "<|start_header_id|>", kLlama3HeaderEnd = "<|end_header_id|>\n\n",
                           kLlama3EndOfTurn = "<|eot_id|>";

// Appends `text` to `out`, and its span to `spans` when `response`.
void emit(RenderedText& out, std::string_view text, bool response) {
  const size_t begin = out.text.size();
  out.text.append(text);
  if (response) out.response_spans.emplace_back(begin, out.text.size());
}

std::string message_field(size_t index) { return fmt::format("messages[{}]", index); }

// Roles after the optional leading system message must go user, assistant, user, ...
void check_alternation(const std::vector<ChatMessage>& messages, size_t first, ChatTemplate chat_template) {
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatRole expected = (i - first) % 2 == 0 ? ChatRole::User : ChatRole::Assistant;
    if (messages[i].role == ChatRole::System)
      FORGE_FAIL("{}.role is \"system\": the {} chat template takes {}", message_field(i),
                 chat_template_name(chat_template),
                 chat_template == ChatTemplate::Mistral ? "no system message"
                                                        : "a system message only as the first message");
    if (messages[i].role != expected)
      FORGE_FAIL("{}.role is \"{}\": the {} chat template needs roles alternating user/assistant/user/... (after "
                 "the optional system message), so this message must be \"{}\"",
                 message_field(i), chat_role_name(messages[i].role), chat_template_name(chat_template),
                 chat_role_name(expected));
  }
}

void render_llama3(const std::vector<ChatMessage>& messages, const ChatSpecialTokens& tokens, RenderedText& out,
                   const std::vector<bool>& trained) {
  size_t first = 0;
  std::string system_message;
  if (messages[0].role == ChatRole::System) {
    system_message = python_strip(messages[0].content);
    first = 1;
  }
  out.text += tokens.bos;
  out.text += kLlama3Header;
  out.text += "system";
  out.text += kLlama3HeaderEnd;
  out.text += "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
  out.text += system_message;
  out.text += kLlama3EndOfTurn;
  for (size_t i = first; i < messages.size(); ++i) {
    out.text += kLlama3Header;
    out.text += chat_role_name(messages[i].role);
    out.text += kLlama3HeaderEnd;
    emit(out, python_strip(messages[i].content) + std::string(kLlama3EndOfTurn), trained[i]);
  }
}

void render_llama2(const std::vector<ChatMessage>& messages, const ChatSpecialTokens& tokens, RenderedText& out,
                   const std::vector<bool>& trained) {
  const bool has_system = messages[0].role == ChatRole::System;
  const size_t first = has_system ? 1 : 0;
  check_alternation(messages, first, ChatTemplate::Llama2);
  for (size_t i = first; i < messages.size(); ++i) {
    std::string content = messages[i].content;
    if (i == first && has_system) content = "<<SYS>>\n" + messages[0].content + "\n<</SYS>>\n\n" + content;
    if (messages[i].role == ChatRole::User)
      out.text += tokens.bos + "[INST] " + python_strip(content) + " [/INST]";
    else
      emit(out, " " + python_strip(content) + " " + tokens.eos, trained[i]);
  }
}

void render_mistral(const std::vector<ChatMessage>& messages, const ChatSpecialTokens& tokens, RenderedText& out,
                    const std::vector<bool>& trained) {
  check_alternation(messages, 0, ChatTemplate::Mistral);
  out.text += tokens.bos;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role == ChatRole::User)
      out.text += "[INST] " + messages[i].content + " [/INST]";
    else
      emit(out, messages[i].content + tokens.eos, trained[i]);
  }
}

// Copies a Jinja string literal starting at s[i] (a quote) to `out`; returns the index
// after its closing quote.
size_t copy_string_literal(std::string_view s, size_t i, std::string& out) {
  const char quote = s[i];
  out += s[i++];
  while (i < s.size() && s[i] != quote) {
    if (s[i] == '\\' && i + 1 < s.size()) out += s[i++];
    out += s[i++];
  }
  if (i < s.size()) out += s[i++];
  return i;
}

}  // namespace

std::string_view chat_template_name(ChatTemplate chat_template) {
  switch (chat_template) {
    case ChatTemplate::Llama3: return "llama3";
    case ChatTemplate::Llama2: return "llama2";
    case ChatTemplate::Mistral: return "mistral";
  }
  return "?";
}

std::optional<ChatTemplate> chat_template_from_name(std::string_view name) {
  for (ChatTemplate t : {ChatTemplate::Llama3, ChatTemplate::Llama2, ChatTemplate::Mistral})
    if (name == chat_template_name(t)) return t;
  return std::nullopt;
}

ChatSpecialTokens default_special_tokens(ChatTemplate chat_template) {
  if (chat_template == ChatTemplate::Llama3) return {.bos = "<|begin_of_text|>", .eos = "<|eot_id|>"};
  return {.bos = "<s>", .eos = "</s>"};
}

std::vector<std::string> template_special_tokens(ChatTemplate chat_template, const ChatSpecialTokens& tokens) {
  if (chat_template == ChatTemplate::Llama3)
    return {tokens.bos, std::string(kLlama3Header), "<|end_header_id|>", std::string(kLlama3EndOfTurn)};
  return {tokens.bos, tokens.eos};
}

std::string python_strip(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end && python_space(utf8::code_point_at(text, begin))) begin += utf8::unit_length(text, begin);
  while (end > begin && python_space(utf8::code_point_before(text, end))) end -= utf8::unit_length_before(text, end);
  return std::string(text.substr(begin, end - begin));
}

RenderedText render_chat(ChatTemplate chat_template, const std::vector<ChatMessage>& messages,
                         const ChatSpecialTokens& tokens, TrainOn train_on) {
  if (messages.empty()) FORGE_FAIL("\"messages\" is an empty list");
  std::vector<bool> trained(messages.size(), false);
  std::optional<size_t> last_assistant;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role != ChatRole::Assistant) continue;
    last_assistant = i;
    trained[i] = train_on == TrainOn::AllAssistantTurns;
  }
  if (!last_assistant)
    FORGE_FAIL("\"messages\" has no assistant message: an example needs a response to train on");
  trained[*last_assistant] = true;
  RenderedText out;
  switch (chat_template) {
    case ChatTemplate::Llama3: render_llama3(messages, tokens, out, trained); break;
    case ChatTemplate::Llama2: render_llama2(messages, tokens, out, trained); break;
    case ChatTemplate::Mistral: render_mistral(messages, tokens, out, trained); break;
  }
  return out;
}

std::string normalize_chat_template(std::string_view s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const bool tag = s[i] == '{' && i + 1 < s.size() && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#');
    if (!tag) {
      const size_t next = std::min(s.find("{{", i), std::min(s.find("{%", i), s.find("{#", i)));
      const std::string_view text = s.substr(i, next == std::string_view::npos ? s.size() - i : next - i);
      bool blank = true;
      for (char c : text) blank = blank && space_char(c);
      if (!blank) out += text;
      i += text.size();
      continue;
    }
    const char kind = s[i + 1];
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    const size_t tag_start = out.size();
    out += s.substr(i, 2);
    i += 2;
    if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
    while (i < s.size() && s.compare(i, 2, close) != 0) {
      if (s[i] == '\'' || s[i] == '"') {
        i = copy_string_literal(s, i, out);
      } else {
        if (!space_char(s[i])) out += s[i];
        ++i;
      }
    }
    if (out.size() > tag_start + 2 && (out.back() == '-' || out.back() == '+')) out.pop_back();
    out += close;
    i = std::min(s.size(), i + 2);
    if (kind == '#') out.resize(tag_start);  // comments render nothing
  }
  return out;
}

std::optional<ChatTemplate> recognize_chat_template(std::string_view jinja) {
  const std::string normalized = normalize_chat_template(jinja);
  for (ChatTemplate t : {ChatTemplate::Llama3, ChatTemplate::Llama2, ChatTemplate::Mistral})
    if (normalized == normalize_chat_template(chat_template_source(t))) return t;
  return std::nullopt;
}

}  // namespace forge
