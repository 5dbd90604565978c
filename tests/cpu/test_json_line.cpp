// json_line_text against Python's json.loads: what Python accepts beyond strict JSON
// (NaN, Infinity, huge numbers, duplicate keys, lone surrogates outside the text) is
// accepted, the text's escapes decode as Python decodes them, and malformed lines are
// refused with the byte offset and what was expected. The end-to-end comparison with
// megatron-core on lines written by json.dumps is tests/python/test_prep_vs_megatron.py.
#include <gtest/gtest.h>

#include <string>

#include "data/json_line.h"

namespace forge {
namespace {

using namespace std::string_literals;

// The text of `line` under "text"; fails the test with the problem when there is one.
std::string text_of(const std::string& line, const std::string& key = "text") {
  std::string text;
  const std::string problem = json_line_text(line, key, text);
  EXPECT_EQ(problem, "") << line;
  return text;
}

std::string problem_of(const std::string& line, const std::string& key = "text") {
  std::string text;
  return json_line_text(line, key, text);
}

void expect_problem(const std::string& line, const std::string& fragment) {
  const std::string problem = problem_of(line);
  EXPECT_NE(problem.find(fragment), std::string::npos) << line << "\ngave: " << problem << "\nlacks: " << fragment;
}

TEST(JsonLine, PythonNumbersInOtherFields) {
  EXPECT_EQ(text_of(R"({"score": NaN, "text": "a", "max": Infinity, "min": -Infinity})"), "a");
  EXPECT_EQ(text_of(R"({"big": 1e400, "small": -1e999, "tiny": 1e-400, "text": "b"})"), "b");
  EXPECT_EQ(text_of(R"({"id": 123456789012345678901234567890123456789012345678901234567890, "text": "c"})"), "c");
  EXPECT_EQ(text_of(R"({"v": [NaN, {"w": -Infinity}], "text": "d", "x": -0, "y": 0.5E+3, "z": 2e-1})"), "d");
  EXPECT_EQ(text_of(R"({"text": "e", "nested": {"a": [1, [2, [3, {"b": {}}]], []], "c": {"d": null}}})"), "e");
}

TEST(JsonLine, DuplicateKeysKeepTheLast) {
  EXPECT_EQ(text_of(R"({"text": "first", "text": "second"})"), "second");
  EXPECT_EQ(text_of(R"({"text": 5, "text": "string wins last"})"), "string wins last");
  EXPECT_EQ(problem_of(R"({"text": "string", "text": null})"), "\"text\" is null, expected a string");
  EXPECT_EQ(text_of(R"({"text": "a\ud800", "text": "fine"})"), "fine");
}

TEST(JsonLine, EscapesDecodeAsPython) {
  EXPECT_EQ(text_of(R"({"text": "q\" b\\ s\/ \b\f\n\r\t"})"), "q\" b\\ s/ \b\f\n\r\t");
  EXPECT_EQ(text_of(R"({"text": "\u00e9\u00E9 \u4e2d \ud83d\ude00 \u0000end"})"),
            "\xc3\xa9\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80 \0end"s);
  EXPECT_EQ(text_of("{\"text\": \"raw \xc3\xa9 \xf0\x9f\x98\x80 \x7f\"}"), "raw \xc3\xa9 \xf0\x9f\x98\x80 \x7f");
  EXPECT_EQ(text_of(R"({"te\u0078t": "escaped key"})"), "escaped key");
  EXPECT_EQ(text_of(R"({"text": ""})"), "");
  EXPECT_EQ(text_of("\xEF\xBB\xBF {\"text\": \"after a byte order mark\"} \r"), "after a byte order mark");
  EXPECT_EQ(text_of(R"({"content": "other key", "text": 1})", "content"), "other key");
}

TEST(JsonLine, LoneSurrogatesOnlyOutsideTheText) {
  EXPECT_EQ(text_of(R"({"title": "\ud800 \udfff \ud800\u0041", "\udc00": 1, "text": "ok"})"), "ok");
  expect_problem(R"({"text": "a\ud800b"})", "lone surrogate escape at byte offset 11");
  expect_problem(R"({"text": "a\udc00"})", "lone surrogate");
  expect_problem(R"({"text": "\ud83d\u0041"})", "lone surrogate");
  expect_problem(R"({"text": "\ud83d"})", "lone surrogate");
}

TEST(JsonLine, WhatPythonRejectsIsRejected) {
  expect_problem("{\"text\": \"tab\there\"}", "byte offset 13: control character 0x09 inside a string");
  expect_problem("{\"text\": \"bad \xff byte\"}", "byte offset 14: invalid UTF-8 byte 0xFF");
  expect_problem("{\"text\": \"surrogate bytes \xed\xa0\x80\"}", "invalid UTF-8 byte 0xED");
  expect_problem("{\"note\": \"overlong \xc0\xaf\", \"text\": \"x\"}", "invalid UTF-8 byte 0xC0");
  expect_problem(R"({"text": "\x41"})", "byte offset 11: invalid escape '\\x'");
  expect_problem(R"({"text": "\u12G4"})", "expected 4 hex digits after \\u");
  expect_problem(R"({"text": "unterminated})", "byte offset 9: the string that starts here has no closing quote");
  expect_problem(R"({"text": "a"} x)", "byte offset 14: unexpected data after the JSON object");
  expect_problem(R"({"text": "a",})", "byte offset 13: expected a string key");
  expect_problem(R"({"text" "a"})", "byte offset 8: expected ':' after an object key");
  expect_problem(R"({"text": "a" "b": 1})", "expected ',' or '}' after an object member");
  expect_problem(R"({'text': 'a'})", "expected a string key (in double quotes)");
  expect_problem(R"({"n": 01, "text": "a"})", "expected ',' or '}'");
  expect_problem(R"({"n": 1., "text": "a"})", "expected a digit after the decimal point");
  expect_problem(R"({"n": 1e, "text": "a"})", "expected a digit in the exponent");
  expect_problem(R"({"n": +1, "text": "a"})", "expected a value");
  expect_problem(R"({"n": .5, "text": "a"})", "expected a value");
  expect_problem(R"({"n": -NaN, "text": "a"})", "expected a number");
  expect_problem(R"({"n": nan, "text": "a"})", "expected a value");
  expect_problem(R"({"n": Inf, "text": "a"})", "expected a number");
  expect_problem(R"({"n": [1, 2,], "text": "a"})", "expected a value");
  expect_problem(R"({"n": [1 2], "text": "a"})", "expected ',' or ']' after an array element");
  expect_problem(R"({"n": {"a" 1}, "text": "a"})", "expected ':' after an object key");
  expect_problem(R"({"n": {"a": 1, }, "text": "a"})", "expected a string key");
  expect_problem(R"({"n": [[[[{"deep": true}]]], "text": "a"})", "expected ',' or ']' after an array element");
  expect_problem(R"({"n": True, "text": "a"})", "expected a value");
  expect_problem(R"({"text": "a")", "expected ',' or '}'");
  expect_problem("", "expected a value");
}

TEST(JsonLine, NotAnObjectOrNoTextString) {
  EXPECT_EQ(problem_of("[1, 2]"), "expected a JSON object, got an array");
  EXPECT_EQ(problem_of(R"("just a string")"), "expected a JSON object, got a string");
  EXPECT_EQ(problem_of("NaN"), "expected a JSON object, got a number");
  expect_problem("[1, 2] 3", "unexpected data after the JSON value");
  EXPECT_EQ(problem_of(R"({"body": "x"})"), "no key \"text\" (give the text's key with --json-key)");
  EXPECT_EQ(problem_of("{}"), "no key \"text\" (give the text's key with --json-key)");
  EXPECT_EQ(problem_of(R"({"nested": {"text": "not top level"}})"),
            "no key \"text\" (give the text's key with --json-key)");
  EXPECT_EQ(problem_of(R"({"text": 5})"), "\"text\" is a number, expected a string");
  EXPECT_EQ(problem_of(R"({"text": ["a", "b"]})"), "\"text\" is an array, expected a string");
  EXPECT_EQ(problem_of(R"({"text": NaN})"), "\"text\" is a number, expected a string");
}

TEST(JsonLine, DeepNestingNeedsNoRecursion) {
  const int depth = 1'000'000;
  const std::string line = "{\"deep\": " + std::string(depth, '[') + std::string(depth, ']') + ", \"text\": \"x\"}";
  EXPECT_EQ(text_of(line), "x");
  expect_problem("{\"deep\": " + std::string(depth, '[') + std::string(depth - 1, ']') + ", \"text\": \"x\"}",
                 "expected ',' or ']' after an array element");
}

}  // namespace
}  // namespace forge
