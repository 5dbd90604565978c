#include "data/tokenizer_pre_tokenizer.h"

#include <fmt/format.h>

#include "data/byte_level.h"
#include "data/unicode_classes.h"

namespace forge {
namespace {

std::unique_ptr<TokenizerPattern> regex_pattern(const std::string& regex, const TokenizerJsonReader& reader,
                                                const std::string& where) {
  return std::make_unique<TokenizerPattern>(nlohmann::json{{"pattern", {{"Regex", regex}}}}, reader, where);
}

// `find(text)` gives the matches of the split's pattern in a piece's text.
template <typename Find>
void split_pieces(std::vector<PreToken>& pieces, Find find, SplitBehavior behavior, bool invert) {
  std::vector<PreToken> out;
  out.reserve(pieces.size());
  for (auto& piece : pieces) {
    for (const auto& [begin, end] : split_ranges(piece.text, find(piece.text), behavior, invert))
      out.push_back({piece.text.substr(begin, end - begin), piece.at_text_start && begin == 0});
  }
  pieces = std::move(out);
}

std::string replace_spaces(std::string_view text, std::string_view replacement) {
  std::string out;
  out.reserve(text.size() + text.size() / 4 * replacement.size());
  for (char c : text) {
    if (c == ' ') {
      out += replacement;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

PreTokenizer::PreTokenizer(const nlohmann::json& config, const TokenizerJsonReader& reader) : file_(reader.file()) {
  if (!config.is_null()) add(config, reader, "pre_tokenizer", 0);
}

// NOTE [Bounded tokenizer pipelines] in tokenizer_json_reader.h.
void PreTokenizer::add(const nlohmann::json& config, const TokenizerJsonReader& reader, const std::string& where,
                       int depth) {
  const std::string type = reader.type(config, where);
  if (type != "Sequence" && steps_.size() >= kMaxPipelineSteps)
    reader.fail(where, fmt::format("more than {} pre-tokenizer steps", kMaxPipelineSteps));
  Step step;
  if (type == "Sequence") {
    if (depth >= kMaxSequenceDepth) reader.fail(where, fmt::format("Sequences nested more than {} deep", kMaxSequenceDepth));
    auto it = config.find("pretokenizers");
    if (it == config.end() || !it->is_array()) reader.fail(where, "a Sequence needs a 'pretokenizers' list");
    for (size_t i = 0; i < it->size(); ++i)
      add((*it)[i], reader, fmt::format("{}.pretokenizers[{}]", where, i), depth + 1);
    return;
  } else if (type == "Split") {
    step.kind = Kind::Split;
    step.pattern = std::make_unique<TokenizerPattern>(config, reader, where);
    const std::string behavior = reader.string(config, where, "behavior");
    auto parsed = split_behavior_from_name(behavior);
    if (!parsed)
      reader.fail(where, fmt::format("behavior '{}' is not one of Removed, Isolated, MergedWithPrevious, "
                                     "MergedWithNext, Contiguous", behavior));
    step.behavior = *parsed;
    step.invert = reader.boolean_or(config, where, "invert", false);
  } else if (type == "ByteLevel") {
    step.kind = Kind::ByteLevel;
    step.add_prefix_space = reader.boolean_or(config, where, "add_prefix_space", true);
    if (reader.boolean_or(config, where, "use_regex", true))
      step.pattern = regex_pattern(byte_level::kGpt2SplitPattern, reader, where);
  } else if (type == "Metaspace") {
    step.kind = Kind::Metaspace;
    step.replacement = reader.string(config, where, "replacement");
    if (step.replacement.empty()) reader.fail(where, "'replacement' must be one character");
    step.split = reader.boolean_or(config, where, "split", true);
    if (config.contains("prepend_scheme")) {
      const std::string scheme = reader.string(config, where, "prepend_scheme");
      if (scheme == "always") step.prepend_scheme = PrependScheme::Always;
      else if (scheme == "first") step.prepend_scheme = PrependScheme::First;
      else if (scheme == "never") step.prepend_scheme = PrependScheme::Never;
      else reader.fail(where, fmt::format("prepend_scheme '{}' is not one of always, first, never", scheme));
    } else {
      step.prepend_scheme = reader.boolean_or(config, where, "add_prefix_space", true) ? PrependScheme::Always
                                                                                      : PrependScheme::Never;
    }
    step.pattern = std::make_unique<TokenizerPattern>(nlohmann::json{{"pattern", {{"String", step.replacement}}}},
                                                      reader, where);
    step.behavior = SplitBehavior::MergedWithNext;
  } else if (type == "Digits") {
    step.kind = Kind::Digits;
    step.behavior = reader.boolean_or(config, where, "individual_digits", false) ? SplitBehavior::Isolated
                                                                                 : SplitBehavior::Contiguous;
  } else {
    reader.unsupported_type(where, type, "Sequence, Split, ByteLevel, Metaspace, Digits");
  }
  steps_.push_back(std::move(step));
}

void PreTokenizer::apply(const Step& step, std::vector<PreToken>& pieces) {
  const auto pattern_matches = [&](std::string_view text) { return step.pattern->find_all(text); };
  switch (step.kind) {
    case Kind::Split:
      split_pieces(pieces, pattern_matches, step.behavior, step.invert);
      break;
    case Kind::Digits:
      split_pieces(pieces, [](std::string_view text) { return find_characters(text, unicode::is_numeric); },
                   step.behavior, false);
      break;
    case Kind::ByteLevel:
      if (step.add_prefix_space) {
        for (auto& piece : pieces)
          if (piece.text.empty() || piece.text[0] != ' ') piece.text.insert(0, " ");
      }
      if (step.pattern) split_pieces(pieces, pattern_matches, SplitBehavior::Isolated, false);
      for (auto& piece : pieces) piece.text = byte_level::encode(piece.text);
      break;
    case Kind::Metaspace:
      for (auto& piece : pieces) {
        piece.text = replace_spaces(piece.text, step.replacement);
        const bool prepend = step.prepend_scheme == PrependScheme::Always ||
                             (step.prepend_scheme == PrependScheme::First && piece.at_text_start);
        if (prepend && !piece.text.starts_with(step.replacement)) piece.text.insert(0, step.replacement);
      }
      if (step.split) split_pieces(pieces, pattern_matches, SplitBehavior::MergedWithNext, false);
      break;
  }
}

void PreTokenizer::pre_tokenize(std::vector<PreToken>& pieces) const {
  auto bytes = [&] {
    size_t total = 0;
    for (const PreToken& piece : pieces) total += piece.text.size();
    return total;
  };
  const size_t input_bytes = bytes();
  for (const auto& step : steps_) {
    apply(step, pieces);
    check_pipeline_growth(file_, "pre-tokenizer", input_bytes, bytes());
  }
}

}  // namespace forge
