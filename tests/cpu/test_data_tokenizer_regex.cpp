// Tokenizer regexes as tokenizers' Oniguruma reads them (NOTE [Oniguruma patterns in PCRE2]):
// the classes and syntax whose PCRE2 meaning differs, the Unicode 16 classes PCRE2 10.42
// lacks, refused constructs, the code point sets behind them, and tokenizers' per-character
// predicates. Expected matches are what tokenizers 0.23 gives; the exhaustive comparison
// with it is tests/python/test_tokenizer_regex_vs_hf.py.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "data/code_point_set.h"
#include "data/tokenizer_regex.h"
#include "data/unicode_classes.h"
#include "data/utf8.h"
#include "expect_error.h"

namespace forge {
namespace {

// The matched substrings of `pattern` in `text`.
std::vector<std::string> matches(const std::string& pattern, const std::string& text) {
  const TokenizerRegex regex(pattern, "test.json", "pattern");
  std::vector<std::string> out;
  for (const auto& [begin, end] : regex.find_all(text)) out.push_back(text.substr(begin, end - begin));
  return out;
}

using Strings = std::vector<std::string>;

std::string utf8_of(char32_t code_point) {
  std::string out;
  utf8::append(out, code_point);
  return out;
}

TEST(TokenizerRegex, WhitespaceIsUnicodeWhiteSpaceWithoutMongolianVowelSeparator) {
  EXPECT_EQ(matches(R"(\s+)", "  \u180e\u180e\u3000\u2028x"), (Strings{"  ", "\u3000\u2028"}));
  EXPECT_EQ(matches(R"(\S+)", " \u180e "), (Strings{"\u180e"}));
  EXPECT_EQ(matches(R"([^\s\p{L}]+)", "a \u180e!"), (Strings{"\u180e!"}));
}

TEST(TokenizerRegex, EscapesMeanWhatOnigurumaMeans) {
  EXPECT_EQ(matches(R"(\h+)", "a0fG \t"), (Strings{"a0f"}));  // hex digits, not horizontal space
  EXPECT_EQ(matches(R"(\v)", "\v\n\r"), (Strings{"\v"}));      // the VT character only
  EXPECT_EQ(matches(R"(\w+)", "a\u0301\u00b2\u24b6_\u2160 b"), (Strings{"a\u0301\u00b2\u24b6_\u2160", "b"}));
  EXPECT_EQ(matches(R"([\w]+)", "a\u00b2b"), (Strings{"a", "b"}));  // ² is \w only outside a class
  EXPECT_EQ(matches(R"(\ba)", "a ba \u0301a"), (Strings{"a"}));
  EXPECT_EQ(matches(R"(\R)", "\r\n\n\u2028"), (Strings{"\r\n", "\n", "\u2028"}));
}

TEST(TokenizerRegex, PropertiesFollowTokenizersUnicodeVersion) {
  const std::string garay_letter = utf8_of(0x10D4A), garay_digit = utf8_of(0x10D40), cjk_i = utf8_of(0x2EBF0);
  const std::string sidetic_letter = utf8_of(0x10940);  // Unicode 17: not yet a letter to tokenizers 0.23
  EXPECT_EQ(matches(R"(\p{L}+)", "a" + garay_letter + cjk_i + "b" + sidetic_letter),
            (Strings{"a" + garay_letter + cjk_i + "b"}));
  EXPECT_EQ(matches(R"(\p{N}+)", "1" + garay_digit), (Strings{"1" + garay_digit}));
  EXPECT_EQ(matches(R"(\p{Mc})", utf8_of(0x1171E)), (Strings{utf8_of(0x1171E)}));  // Mn until Unicode 15
  EXPECT_EQ(matches(R"(\P{L}+)", "a" + sidetic_letter), (Strings{sidetic_letter}));
  EXPECT_EQ(matches(R"(\p{^L}+)", "1a"), (Strings{"1"}));
}

TEST(TokenizerRegex, AnchorsOptionsAndQuantifiersReadAsOniguruma) {
  EXPECT_EQ(matches(R"(^a|b$)", "a\nab\nb"), (Strings{"a", "a", "b", "b"}));
  EXPECT_EQ(matches(R"((?m:a.b))", "a\nb"), (Strings{"a\nb"}));
  EXPECT_EQ(matches(R"(a(?i)b|c)", "c ab aB C"), (Strings{"ab", "aB"}));
  EXPECT_EQ(matches(R"((?i:'s|'t))", "'S '\u017f 'T"), (Strings{"'S", "'\u017f", "'T"}));
  EXPECT_EQ(matches(R"(a{,2})", "aaa"), (Strings{"aa", "a"}));
  EXPECT_EQ(matches(R"(xa{2}?)", "x"), (Strings{"x"}));
  EXPECT_EQ(matches(R"(a{1,2}+)", "aaaaa"), (Strings{"aaaaa"}));
  EXPECT_EQ(matches(R"(x{a})", "x{a}"), (Strings{"x{a}"}));
}

TEST(TokenizerRegex, ClassesNestAndIntersect) {
  EXPECT_EQ(matches(R"([a-c&&b-d]+)", "abcd"), (Strings{"bc"}));
  EXPECT_EQ(matches(R"( ?[^(\s|[.,!?])]+)", "hi, (you) !"), (Strings{"hi", "you"}));
  EXPECT_EQ(matches(R"([a-c-e]+)", "abde-"), (Strings{"ab", "e-"}));
}

TEST(TokenizerRegex, EmptyMatchRightAfterAMatchIsSkipped) {
  EXPECT_EQ(matches("x*", "axb"), (Strings{"", "x", ""}));
  EXPECT_EQ(matches("b|(?=c)", "bxc"), (Strings{"b", ""}));
}

TEST(TokenizerRegex, LongRepeatedGroupsOutgrowTheJitStack) {
  const std::string text(1 << 20, 'a');
  EXPECT_EQ(matches(R"((?:a|b)+)", text), (Strings{text}));
}

TEST(TokenizerRegex, UntranslatedConstructsAreRefusedByName) {
  for (const auto& [pattern, construct] : std::vector<std::pair<std::string, std::string>>{
           {R"(\p{Han})", R"(\p{Han})"}, {"[[:alpha:]]", "POSIX"}, {R"((a)\1)", "backreferences"},
           {R"(\Ga)", R"(\G)"}, {"(?x)a", "(?x"}, {"(?i:[a-z])", "case-insensitive"}, {"(?i:ss)", "\"ss\""},
           {"(?i:\u00e9)", "non-ASCII"}}) {
    expect_error([&] { matches(pattern, "a"); }, {"test.json", "pattern", "regex '" + pattern + "'", construct});
  }
  expect_error([] { matches("(unclosed", "a"); }, {"test.json", "invalid regex '(unclosed'", "without its )"});
  expect_error([] { matches(R"(\x{D800})", "a"); }, {"invalid regex", "not a Unicode scalar value"});
}

TEST(CodePointSet, KeepsSortedDisjointRangesWithoutSurrogates) {
  CodePointSet set;
  set.add(10, 20);
  set.add(30, 40);
  set.add(21, 29);
  ASSERT_EQ(set.ranges().size(), 1u);
  EXPECT_EQ(set.ranges()[0].first, 10u);
  EXPECT_EQ(set.ranges()[0].last, 40u);
  set.add(0xD000, 0xE100);
  EXPECT_TRUE(set.contains(0xD7FF));
  EXPECT_FALSE(set.contains(0xD800));
  EXPECT_TRUE(set.contains(0xE000));
  EXPECT_EQ(set.complement().complement(), set);
  EXPECT_FALSE(set.complement().contains(0xDC00));
  CodePointSet other;
  other.add(35, 0xD900);
  EXPECT_EQ(set.intersection(other).ranges().size(), 2u);
  EXPECT_TRUE(set.difference(other).contains(34));
  EXPECT_FALSE(set.difference(other).contains(35));
  EXPECT_TRUE(CodePointSet::all().contains(0x10FFFF));
}

TEST(UnicodeClasses, PredicatesFollowTokenizers) {
  EXPECT_TRUE(unicode::is_numeric(0x11DE0));    // Tolong Siki digit zero: Unicode 17, Rust's is_numeric has it
  EXPECT_FALSE(unicode::is_numeric(0x180E));
  EXPECT_FALSE(unicode::is_numeric(-1));
  EXPECT_TRUE(unicode::is_added_token_word_character(0x200C));   // Join_Control is the regex crate's \w
  EXPECT_FALSE(unicode::is_added_token_word_character(0x00B2));  // ² is not
  EXPECT_TRUE(unicode::is_added_token_word_character(0x10D4A));  // Garay letter, Unicode 16
  EXPECT_FALSE(unicode::is_added_token_word_character(-1));
  EXPECT_FALSE(unicode::property("Han").has_value());
  CodePointSet letters = *unicode::property("Lu");
  for (const char* part : {"Ll", "Lt", "Lm", "Lo"}) letters.add(*unicode::property(part));
  EXPECT_EQ(letters, *unicode::property("L"));
}

}  // namespace
}  // namespace forge
