// Hash maps keyed by std::string that are looked up with a std::string_view, without
// building a string per lookup: tokenizers look up slices of the text they encode.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace forge {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

template <typename Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;

using TokenIdMap = StringMap<int32_t>;

}  // namespace forge
