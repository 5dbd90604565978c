#include "data/tokenizer_normalizer.h"

#include <fmt/format.h>

#include "data/unicode_normalization.h"

namespace forge {

Normalizer::Normalizer(const nlohmann::json& config, const TokenizerJsonReader& reader) : file_(reader.file()) {
  if (!config.is_null()) add(config, reader, "normalizer", 0);
}

// NOTE [Bounded tokenizer pipelines] in tokenizer_json_reader.h.
void Normalizer::add(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& where,
                     int depth) {
  const std::string type = reader.type(config, where);
  if (type != "Sequence" && steps_.size() >= kMaxPipelineSteps)
    reader.fail(where, fmt::format("more than {} normalizer steps", kMaxPipelineSteps));
  if (type == "Sequence") {
    if (depth >= kMaxSequenceDepth) reader.fail(where, fmt::format("Sequences nested more than {} deep", kMaxSequenceDepth));
    auto it = config.find("normalizers");
    if (it == config.end() || !it->is_array()) reader.fail(where, "a Sequence needs a 'normalizers' list");
    for (size_t i = 0; i < it->size(); ++i)
      add((*it)[i], reader, fmt::format("{}.normalizers[{}]", where, i), depth + 1);
  } else if (type == "Prepend") {
    Step step;
    step.kind = Kind::Prepend;
    step.prepend = reader.string(config, where, "prepend");
    if (!step.prepend.empty()) steps_.push_back(std::move(step));
  } else if (type == "Replace") {
    Step step;
    step.pattern = std::make_unique<TokenizerPattern>(config, reader, where);
    if (!step.pattern->find_all("").empty())
      reader.fail(where, "the Replace pattern matches the empty string: it would insert its content between every "
                         "two characters");
    step.content = reader.string(config, where, "content");
    steps_.push_back(std::move(step));
  } else if (type == "NFC" || type == "Lowercase") {
    Step step;
    step.kind = type == "NFC" ? Kind::Nfc : Kind::Lowercase;
    steps_.push_back(std::move(step));
  } else {
    reader.unsupported_type(where, type, "Sequence, Prepend, Replace, NFC, Lowercase");
  }
}

void Normalizer::normalize(std::string& text) const {
  const size_t input_bytes = text.size();
  for (const auto& step : steps_) {
    switch (step.kind) {
      case Kind::Prepend:
        if (!text.empty()) text.insert(0, step.prepend);
        break;
      case Kind::Replace:
        text = step.pattern->replace_all(text, step.content);
        break;
      case Kind::Nfc:
        unicode::nfc(text);
        break;
      case Kind::Lowercase:
        unicode::lowercase(text);
        break;
    }
    check_pipeline_growth(file_, "normalizer", input_bytes, text.size());
  }
}

}  // namespace forge
