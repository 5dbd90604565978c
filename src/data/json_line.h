// The document of one JSON Lines line: the string under one key of the line's object,
// read as Python's json.loads reads it (Megatron's tools/preprocess_data.py reads its
// --input that way, and Python's json.dumps writes the lines most corpora hold).
//
// NOTE [Python's JSON]
// Python's json module reads more than RFC 8259 allows, and json.dumps writes some of it
// by default:
//   - NaN, Infinity and -Infinity as numbers (json.dumps writes them for float nan / inf);
//   - numbers beyond double range (1e400 reads as inf) and integers of any size;
//   - duplicate keys: the last one wins;
//   - \uXXXX escapes of lone surrogates (\ud800), read as lone surrogate code points;
//   - any value at the top level.
// forge accepts all of these wherever Python does. It keeps rejecting what Python rejects:
// control characters inside strings, bad escapes, invalid UTF-8 (Python decodes the whole
// file before parsing a line), anything after the value. Two of Python's limits are not
// copied, as they only refuse lines: integers of more than 4300 digits
// (sys.get_int_max_str_digits) and nesting deeper than the recursion limit. A UTF-8 byte
// order mark before the value is ignored (forge always accepted one; Python refuses it).
//
// The text under the key is decoded exactly as Python decodes it (a surrogate pair is one
// code point) and returned as UTF-8, the bytes Megatron's tokenizers see. A lone surrogate
// has no UTF-8 form: Python's json reads it, but Megatron's tokenize then fails on the str
// (Hugging Face tokenizers raises TypeError, sentencepiece RuntimeError; only tiktoken
// would put U+FFFD in its place), so in the text it makes the line bad, like any other
// malformed line. Elsewhere in the line it is accepted.
//
// NOTE [Scanning without a DOM]
// The line is scanned once, left to right. The values of other keys are validated and
// skipped without being built (nesting is tracked on a small stack, not by recursion, so
// no line can exhaust the call stack), and only the string under the key is decoded.
#pragma once

#include <string>
#include <string_view>

namespace forge {

// Why `line` holds no document, or an empty string when it does; then the text under
// `key` is in `text`. The reasons read like "not valid JSON at byte offset 17: expected
// ':' after an object key" or "\"text\" is a number, expected a string".
std::string json_line_text(std::string_view line, std::string_view key, std::string& text);

}  // namespace forge
