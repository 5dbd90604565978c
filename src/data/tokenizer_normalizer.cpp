#include "data/tokenizer_normalizer.h"

#include <fmt/format.h>


namespace forge {

Normalizer::Normalizer(const nlohmann::json& config, const TokenizerJsonReader& reader) {
  if (!config.is_null()) add(config, reader, "normalizer");
}

void Normalizer::add(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& where) {
  const std::string type = reader.type(config, where);
  if (type == "Sequence") {
    auto it = config.find("normalizers");
    if (it == config.end() || !it->is_array()) reader.fail(where, "a Sequence needs a 'normalizers' list");
    for (size_t i = 0; i < it->size(); ++i) add((*it)[i], reader, fmt::format("{}.normalizers[{}]", where, i));
  } else if (type == "Prepend") {
    Step step;
    step.prepend = reader.string(config, where, "prepend");
    if (!step.prepend.empty()) steps_.push_back(std::move(step));
  } else if (type == "Replace") {
    Step step;
    step.pattern = std::make_unique<TokenizerPattern>(config, reader, where);
    step.content = reader.string(config, where, "content");
    steps_.push_back(std::move(step));
  } else {
    reader.unsupported_type(where, type, "Sequence, Prepend, Replace");
  }
}

void Normalizer::normalize(std::string& text) const {
  for (const auto& step : steps_) {
    if (!step.prepend.empty()) {
      if (!text.empty()) text.insert(0, step.prepend);
    } else {
      text = step.pattern->replace_all(text, step.content);
    }
  }
}

}  // namespace forge
