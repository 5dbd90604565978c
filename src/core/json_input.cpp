// Bounded JSON input; see NOTE [Bounded JSON input].
#include "core/json_input.h"

#include "core/error.h"
#include "core/input_file.h"

namespace forge {

void check_json_depth(std::string_view text, const std::string& source) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth)
        FORGE_FAIL("{}: JSON nested deeper than {} levels (at byte {})", source, kMaxJsonDepth, i);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

nlohmann::json parse_json(std::string_view text, const std::string& source) {
  check_json_depth(text, source);
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    FORGE_FAIL("{}: not valid JSON: {}", source, e.what());
  }
}

nlohmann::json read_json_file(const std::string& path, std::string_view what) {
  return parse_json(read_regular_file(path, what), path);
}

std::string describe_json(const nlohmann::json& value) {
  constexpr size_t kMaxChars = 60;
  switch (value.type()) {
    case nlohmann::json::value_t::object:
      return fmt::format("an object of {} member{}", value.size(), value.size() == 1 ? "" : "s");
    case nlohmann::json::value_t::array:
      return fmt::format("a list of {} item{}", value.size(), value.size() == 1 ? "" : "s");
    case nlohmann::json::value_t::string: {
      const std::string& s = value.get_ref<const std::string&>();
      if (s.size() <= kMaxChars) return value.dump();
      size_t cut = kMaxChars;
      while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // whole UTF-8 characters
      return nlohmann::json(s.substr(0, cut)).dump() + "... (" + std::to_string(s.size()) + " bytes)";
    }
    default:
      return value.dump();
  }
}

}  // namespace forge
