// What config rules are written with: ValueRange, a number's allowed interval, and
// KeyDescriber, through which a rule names the keys in its message. The rules themselves
// live beside what they constrain (model/config_rules.h, optim/config_rules.h).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace forge {

// Bounds are inclusive unless the matching *_exclusive flag is set; NaN is in no range.
struct ValueRange {
  std::optional<double> min, max;
  bool min_exclusive = false;
  bool max_exclusive = false;

  bool contains(double value) const;
  // ">= 1", "> 0", "in [0, 1)"; empty when unbounded.
  std::string describe() const;
};

constexpr ValueRange at_least(double min) { return {min, std::nullopt}; }
constexpr ValueRange above(double min) { return {min, std::nullopt, true}; }

// NOTE [Config rules name their keys through the caller]
// Each config rule ("model.num_heads must be divisible by model.num_kv_heads") is written
// once, beside what it constrains, and runs on two paths: the cli's, which knows where
// every value came from, and every caller without a config file (the DecoderLM
// constructor, Hugging Face import, tests). A rule names each key it involves through a
// KeyDescriber, and the caller decides how much can be said:
//   KeyDescriber{}             model.num_heads (30)
//   KeyDescriber{origin_of}    model.num_heads = 30 (exp.yaml:5)
// So model/ and optim/ know nothing of files or the command line, and a rule has one
// sentence whichever path reports it.
class KeyDescriber {
 public:
  // Where a key's value came from: "exp.yaml:5", "command line", "default value".
  using OriginOf = std::function<std::string(std::string_view key)>;

  KeyDescriber() = default;
  explicit KeyDescriber(OriginOf origin_of) : origin_of_(std::move(origin_of)) {}

  // "model.num_heads (30)", or "model.num_heads = 30 (exp.yaml:5)" where origins are known.
  std::string describe(std::string_view key, const auto& value) const {
    return describe_text(key, fmt::format("{}", value));
  }

  // " (exp.yaml:5)" where origins are known, else empty: for messages that end in a value.
  std::string origin_suffix(std::string_view key) const;

 private:
  std::string describe_text(std::string_view key, const std::string& value) const;

  OriginOf origin_of_;
};

// Fails with "<key> must be <range>, got <value>", plus the value's origin where known.
template <typename Number>
void check_range(const KeyDescriber& keys, std::string_view key, Number value, const ValueRange& range) {
  if (!range.contains(static_cast<double>(value)))
    FORGE_FAIL("{} must be {}, got {}{}", key, range.describe(), value, keys.origin_suffix(key));
}

// Fails with "<key> must be one of a, b, c, got 'x'" ("must be a" when there is one
// choice), plus the value's origin where known.
void check_choice(const KeyDescriber& keys, std::string_view key, const std::string& value,
                  const std::vector<std::string>& choices);

}  // namespace forge
