// ValueRange, KeyDescriber and the single-value checks; see config_check.h.
#include "core/config_check.h"

#include <algorithm>
#include <cmath>

#include <fmt/ranges.h>

namespace forge {

bool ValueRange::contains(double value) const {
  if (std::isnan(value)) return false;
  if (min && !(min_exclusive ? value > *min : value >= *min)) return false;
  if (max && !(max_exclusive ? value < *max : value <= *max)) return false;
  return true;
}

std::string ValueRange::describe() const {
  if (min && max)
    return fmt::format("in {}{}, {}{}", min_exclusive ? '(' : '[', *min, *max, max_exclusive ? ')' : ']');
  if (min) return fmt::format("{} {}", min_exclusive ? ">" : ">=", *min);
  if (max) return fmt::format("{} {}", max_exclusive ? "<" : "<=", *max);
  return "";
}

std::string KeyDescriber::origin_suffix(std::string_view key) const {
  return origin_of_ ? fmt::format(" ({})", origin_of_(key)) : "";
}

std::string KeyDescriber::describe_text(std::string_view key, const std::string& value) const {
  if (!origin_of_) return fmt::format("{} ({})", key, value);
  return fmt::format("{} = {} ({})", key, value, origin_of_(key));
}

void check_choice(const KeyDescriber& keys, std::string_view key, const std::string& value,
                  const std::vector<std::string>& choices) {
  if (std::find(choices.begin(), choices.end(), value) != choices.end()) return;
  const std::string expected =
      choices.size() == 1 ? choices.front() : fmt::format("one of {}", fmt::join(choices, ", "));
  FORGE_FAIL("{} must be {}, got '{}'{}", key, expected, value, keys.origin_suffix(key));
}

}  // namespace forge
