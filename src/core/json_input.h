// Parsing JSON that a user handed forge (checkpoint metadata, safetensors headers, Hugging
// Face config and index files, tokenizer.json, report inputs) and describing its values in
// error messages.
//
// NOTE [Bounded JSON input]
// nlohmann's parser copes with any nesting, but what forge does with the result may
// recurse: json::dump() in an error message, or a walk over a tokenizer's nested Sequence
// components, runs out of stack on `[[[[...]]]]` a few hundred thousand levels deep. So
// every user JSON is checked against kMaxJsonDepth before it is parsed (real files nest a
// handful of levels), every exception nlohmann throws (a parse error, but also a number
// out of range such as 1e400) becomes a forge::Error naming the file, and messages show
// a value through describe_json, which prints scalars (strings cut short) and only the
// size of an object or a list, never its contents.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace forge {

inline constexpr int kMaxJsonDepth = 128;

// Throws forge::Error "<source>: JSON nested deeper than 128 levels (at byte N)".
void check_json_depth(std::string_view text, const std::string& source);

// check_json_depth, then parse; any nlohmann error throws forge::Error "<source>: not
// valid JSON: ...".
nlohmann::json parse_json(std::string_view text, const std::string& source);

// The regular file at `path` (NOTE [User files must be regular files]) parsed as above;
// `what` names it in errors ("the model's config.json").
nlohmann::json read_json_file(const std::string& path, std::string_view what = "JSON file");

// A bounded rendering for messages: 12, true, null, "text" (cut after 60 characters
// with "..."), an object of 3 members, a list of 2 items.
std::string describe_json(const nlohmann::json& value);

}  // namespace forge
