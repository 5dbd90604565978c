#include "data/tokenizer_json_reader.h"

#include "core/error.h"

namespace forge {

void check_pipeline_growth(const std::string& file, std::string_view pipeline, size_t input_bytes, size_t bytes) {
  const size_t bound = 16 * input_bytes + (size_t{1} << 20);
  if (bytes > bound)
    FORGE_FAIL("{}: the {} grew a text of {} bytes to {} bytes (more than 16 times plus 1 MiB): its steps feed on "
               "each other's output",
               file, pipeline, input_bytes, bytes);
}

void TokenizerJsonReader::fail(std::string_view where, std::string_view what) const {
  FORGE_FAIL("{}: {}: {}", file_, where, what);
}

const nlohmann::json& TokenizerJsonReader::member(const nlohmann::json& parent, std::string_view where,
                                                  const char* key) const {
  if (!parent.is_object()) fail(where, "expected a JSON object");
  auto it = parent.find(key);
  if (it == parent.end()) fail(where, fmt::format("missing '{}'", key));
  return *it;
}

const nlohmann::json& TokenizerJsonReader::object(const nlohmann::json& parent, std::string_view where,
                                                  const char* key) const {
  const auto& value = member(parent, where, key);
  if (!value.is_object()) fail(where, fmt::format("'{}' must be a JSON object", key));
  return value;
}

std::string TokenizerJsonReader::string(const nlohmann::json& parent, std::string_view where, const char* key) const {
  const auto& value = member(parent, where, key);
  if (!value.is_string()) fail(where, fmt::format("'{}' must be a string", key));
  return value.get<std::string>();
}

std::string TokenizerJsonReader::string_or(const nlohmann::json& parent, std::string_view where, const char* key,
                                           const std::string& fallback) const {
  if (!parent.is_object()) fail(where, "expected a JSON object");
  auto it = parent.find(key);
  if (it == parent.end() || it->is_null()) return fallback;
  if (!it->is_string()) fail(where, fmt::format("'{}' must be a string or null", key));
  return it->get<std::string>();
}

bool TokenizerJsonReader::boolean_or(const nlohmann::json& parent, std::string_view where, const char* key,
                                     bool fallback) const {
  if (!parent.is_object()) fail(where, "expected a JSON object");
  auto it = parent.find(key);
  if (it == parent.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) fail(where, fmt::format("'{}' must be true or false", key));
  return it->get<bool>();
}

int64_t TokenizerJsonReader::integer(const nlohmann::json& parent, std::string_view where, const char* key) const {
  const auto& value = member(parent, where, key);
  if (!value.is_number_integer()) fail(where, fmt::format("'{}' must be an integer", key));
  return value.get<int64_t>();
}

std::string TokenizerJsonReader::type(const nlohmann::json& component, std::string_view where) const {
  return string(component, where, "type");
}

void TokenizerJsonReader::unsupported_type(std::string_view where, std::string_view type,
                                           std::string_view supported) const {
  fail(where, fmt::format("type '{}' is not supported (supported: {})", type, supported));
}

}  // namespace forge
