#include "data/tokenizer_decoder.h"

#include <fmt/format.h>

#include <optional>

#include "data/byte_level.h"
#include "data/utf8.h"

namespace forge {
namespace {

std::string byte_level_decode(const std::string& token) {
  std::string bytes;
  for (size_t pos = 0; pos < token.size(); pos += utf8::unit_length(token, pos)) {
    const int byte = byte_level::byte_of(utf8::code_point_at(token, pos));
    if (byte < 0) return token;  // not a byte-level token (e.g. a special token): its own text
    bytes += static_cast<char>(byte);
  }
  return bytes;
}

std::optional<char> byte_fallback_value(const std::string& token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int high = hex(token[3]), low = hex(token[4]);
  if (high < 0 || low < 0) return std::nullopt;
  return static_cast<char>(high * 16 + low);
}

std::string strip(const std::string& token, std::string_view character, int64_t start, int64_t stop) {
  std::vector<size_t> starts;  // byte offset of each character
  for (size_t pos = 0; pos < token.size(); pos += utf8::unit_length(token, pos)) starts.push_back(pos);
  auto char_at = [&](size_t i) {
    const size_t end = i + 1 < starts.size() ? starts[i + 1] : token.size();
    return std::string_view(token).substr(starts[i], end - starts[i]);
  };
  size_t first = 0, last = starts.size();
  for (int64_t i = 0; i < start && first < starts.size() && char_at(first) == character; ++i) ++first;
  for (int64_t i = 0; i < stop && last > first && char_at(last - 1) == character; ++i) --last;
  const size_t begin = first < starts.size() ? starts[first] : token.size();
  const size_t end = last < starts.size() ? starts[last] : token.size();
  return token.substr(begin, end - begin);
}

}  // namespace

Decoder::Decoder(const nlohmann::json& config, const TokenizerJsonReader& reader) {
  present_ = !config.is_null();
  if (present_) add(config, reader, "decoder");
}

void Decoder::add(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& where) {
  const std::string type = reader.type(config, where);
  Step step;
  if (type == "Sequence") {
    auto it = config.find("decoders");
    if (it == config.end() || !it->is_array()) reader.fail(where, "a Sequence needs a 'decoders' list");
    for (size_t i = 0; i < it->size(); ++i) add((*it)[i], reader, fmt::format("{}.decoders[{}]", where, i));
    return;
  } else if (type == "ByteLevel") {
    step.kind = Kind::ByteLevel;
  } else if (type == "Replace") {
    step.kind = Kind::Replace;
    step.pattern = std::make_unique<TokenizerPattern>(config, reader, where);
    step.content = reader.string(config, where, "content");
  } else if (type == "ByteFallback") {
    step.kind = Kind::ByteFallback;
  } else if (type == "Fuse") {
    step.kind = Kind::Fuse;
  } else if (type == "Strip") {
    step.kind = Kind::Strip;
    step.content = reader.string(config, where, "content");
    step.strip_start = reader.integer(config, where, "start");
    step.strip_stop = reader.integer(config, where, "stop");
  } else if (type == "Metaspace") {
    step.kind = Kind::Metaspace;
    step.content = reader.string(config, where, "replacement");
    if (config.contains("prepend_scheme")) {
      step.strip_first_replacement = reader.string(config, where, "prepend_scheme") != "never";
    } else {
      step.strip_first_replacement = reader.boolean_or(config, where, "add_prefix_space", true);
    }
  } else {
    reader.unsupported_type(where, type, "Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace");
  }
  steps_.push_back(std::move(step));
}

void Decoder::apply(const Step& step, std::vector<std::string>& tokens) {
  switch (step.kind) {
    case Kind::ByteLevel: {
      std::string text;
      for (const auto& token : tokens) text += byte_level_decode(token);
      tokens = {std::move(text)};
      break;
    }
    case Kind::Replace:
      for (auto& token : tokens) token = step.pattern->replace_all(token, step.content);
      break;
    case Kind::ByteFallback: {
      std::vector<std::string> out;
      std::string pending_bytes;
      for (auto& token : tokens) {
        if (auto byte = byte_fallback_value(token)) {
          pending_bytes += *byte;
          continue;
        }
        if (!pending_bytes.empty()) out.push_back(std::move(pending_bytes)), pending_bytes.clear();
        out.push_back(std::move(token));
      }
      if (!pending_bytes.empty()) out.push_back(std::move(pending_bytes));
      tokens = std::move(out);
      break;
    }
    case Kind::Fuse: {
      std::string text;
      for (const auto& token : tokens) text += token;
      tokens = {std::move(text)};
      break;
    }
    case Kind::Strip:
      for (auto& token : tokens) token = strip(token, step.content, step.strip_start, step.strip_stop);
      break;
    case Kind::Metaspace:
      for (size_t i = 0; i < tokens.size(); ++i) {
        const bool drop = i == 0 && step.strip_first_replacement;
        std::string out;
        for (size_t pos = 0; pos < tokens[i].size();) {
          const size_t length = utf8::unit_length(tokens[i], pos);
          if (std::string_view(tokens[i]).substr(pos, length) == step.content) {
            if (!drop) out += ' ';
          } else {
            out.append(tokens[i], pos, length);
          }
          pos += length;
        }
        tokens[i] = std::move(out);
      }
      break;
  }
}

std::string Decoder::decode(std::vector<std::string> tokens) const {
  std::string text;
  if (!present_) {
    for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
    return text;
  }
  for (const auto& step : steps_) apply(step, tokens);
  for (const auto& token : tokens) text += token;
  return text;
}

}  // namespace forge
