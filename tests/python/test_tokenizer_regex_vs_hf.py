"""forge's tokenizer regexes against tokenizers' own (Oniguruma), on every code point.

tools/forge_regex splits texts with a pattern as forge translates and runs it (TokenizerRegex
and split_ranges); tokenizers' Split pre-tokenizer does the same with its engine. The pieces
must be equal:
  - each class the published split patterns use (\\s, \\w, \\p{L}, [^\\s\\p{L}\\p{N}], ...),
    the other escapes whose meaning differs between the engines (\\h, \\v, \\b, ., \\R,
    case-insensitive letters) and every general category, over one text holding every
    Unicode scalar value: a class that differs on any code point splits it differently;
  - the published patterns (Llama 3, GPT-2, GPT-4o, Qwen2, Mistral's Tekken, DeepSeek,
    BLOOM) over that text and over texts of whitespace, format characters and letters
    added in Unicode 15 and 16, with every split behavior;
  - the Oniguruma syntax forge translates (line anchors, isolated options, nested and
    intersected classes, stacked quantifiers, empty matches) on small texts.
Constructs forge does not translate must be refused with a message naming them.
"""
import functools
import json
import os
import shutil
import string
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402
import tokenizer_fixtures as fixtures  # noqa: E402
import unicode_oracle as oracle  # noqa: E402
import unicode_texts  # noqa: E402

BEHAVIORS = ["removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"]

PUBLISHED_PATTERNS = {
    "llama3": fixtures.LLAMA3_SPLIT_PATTERN,
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "gpt4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
             r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "tekken": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
              r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",
    "deepseek-v3-cjk": r"[一-龥\u3040-ゟ゠-ヿ]+",
    "deepseek-v3": r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                   r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "deepseek-llm-punctuation": r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "deepseek-llm-trailing-space": r"\s+$",
    "bloom": r" ?[^(\s|[.,!?…。，、।۔،])]+",
}

# One-character classes, each checked on every code point. \v, \h, \w (which Oniguruma
# reads differently inside a class), \s, ., \R and the general categories all mean
# something else in PCRE2 (NOTE [Oniguruma patterns in PCRE2]).
CLASS_PATTERNS = [
    r"\s", r"\S", r"\w", r"\W", r"\d", r"\D", r"\h", r"\v", r".", r"\N", r"\R",
    r"\p{L}", r"\p{Lu}", r"\p{Ll}", r"\p{Lt}", r"\p{Lm}", r"\p{Lo}", r"\p{LC}", r"\p{M}", r"\p{Mn}", r"\p{N}",
    r"\p{Nd}", r"\p{P}", r"\p{S}", r"\p{Z}", r"\p{C}", r"\p{Cn}", r"\P{L}", r"\p{^N}",
    r"[^\r\n\p{L}\p{N}]", r"[^\s\p{L}\p{N}]", r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]",
    r"[\p{L}\p{M}]", r"[\p{P}\p{S}]", r"[^\r\n\p{L}\p{P}\p{S}]", r"[\w]", r"[\W]", r"[\w&&\P{L}]", r"[\s\d\h]",
    "(?i:" + "|".join(string.ascii_lowercase) + ")",
]
# Every general category at once: the pieces are the runs of one category, so a code point
# forge puts in another category than tokenizers does moves a boundary.
GENERAL_CATEGORY_RUNS = "|".join(rf"\p{{{name}}}+" for name in oracle.GENERAL_CATEGORIES if name != "Cs")

# Oniguruma syntax that PCRE2 reads otherwise, on texts that tell the readings apart.
SYNTAX_CASES = [
    (r"^a|b$", "a\nab\nb\r\nb"), (r"a(?i)b|c", "c ab aB C"), (r"(?i)a|b", "A B a"), (r"x(?i)|c", "c x"),
    (r"(?m:a.b)|(?-m:c.d)", "a\nb c\nd"), (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)", "'S 'ſ 'T 'RE 'Ve 'M 'LL 'D 'K"),
    (r"(?i:k)+", "kK\u212ak"), (r"a{,2}", "aaaaa"), (r"xa{2}?", "x xaa xaaa"), (r"a{1,2}+", "aaaaa"),
    (r"a{2}{3}", "aaaaaaaa"), (r"a**b", "aaab"), (r"a+?", "aaa"), (r"a*+a", "aaa"), (r"x{", "x{ x{} x{a} x{1"),
    (r"[a-c&&b-d]", "abcde"), (r"[^a-c&&b-d]", "abcde"), (r"[a[bc]]d", "ad bd cd dd"), (r"[a-c-e]", "abcde-"),
    (r"[]a]", "]a"), (r"[^]a]", "]ab"), (r"[\b]", "\bb"), (r"\x41\x{42}\u0043\0", "ABC\x00"), (r"\e\a\t", "\x1b\x07\t"),
    (r"x*", "axb"), (r"b|(?=c)", "bxc"), (r"(?=c)|c", "ccc"), (r"\ba\b", "a ba a\u0300 \u00b2a a_"),
    (r"\Ba", "ba a"), (r"\z|\Z", "a\n"), (r"\h+\H", "0fF9g x"), (r"\v+", "\x0b\n\r"), (r"\R", "a\r\nb\n\rc\u2028"),
    (r"\N+|\O", "ab\ncd"), (r"(?<name>a)(?:b)(c)(?#comment)*", "abc abcc"), (r"(?<=a)b|(?<!a)c", "ab cb ac c"),
    (r"\s+", "  \u180e\u180e\u3000 \u2028"),
]

UNSUPPORTED = {
    r"\p{Han}": r"\p{Han}", r"\p{Letter}": r"\p{Letter}", r"[[:alpha:]]": "POSIX bracket",
    r"(a)\1": "backreferences", r"(?<n>a)\k<n>": r"\k", r"\Ga": r"\G", r"a\K": r"\K", r"\X": r"\X",
    r"(?x) a": "(?x", r"(?i:[a-z])": "a character class in a case-insensitive group",
    r"(?i:\w)": r"\w in a case-insensitive group", r"(?i:é)": "non-ASCII", r"(?i:ss)": "\"ss\"",
    r"(?i)sT": "\"st\"", r"\pL": r"\p or \P without {name}", r"(?~abc)": "(?~", r"\cA": r"\c",
}


def forge_split(requests):
    """forge_regex's answers: pieces, or the error text, per request."""
    directory = forge_test_util.scratch_dir()
    try:
        path = os.path.join(directory, "requests.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for request in requests:
                f.write(json.dumps(request) + "\n")
        result = forge_test_util.run([forge_test_util.tool("forge_regex"), path])
        answers = [json.loads(line) for line in result.stdout.splitlines()]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return [answer["pieces"] if "pieces" in answer else answer["error"] for answer in answers]


@functools.lru_cache(maxsize=None)
def hf_splitter(pattern, behavior):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Split(Regex(pattern), behavior=behavior)


def hf_split(pattern, behavior, text):
    return [list(offsets) for _, offsets in hf_splitter(pattern, behavior).pre_tokenize_str(text)]


class RegexVsTokenizers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        cls.all_scalar_values = os.path.join(cls.directory, "all.txt")
        with open(cls.all_scalar_values, "w", encoding="utf-8") as f:
            f.write(oracle.ALL_SCALAR_VALUES_TEXT)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def check_on_every_code_point(self, patterns, behavior):
        answers = forge_split([{"pattern": p, "behavior": behavior, "text_file": self.all_scalar_values}
                               for p in patterns])
        for pattern, pieces in zip(patterns, answers):
            expected = hf_split(pattern, behavior, oracle.ALL_SCALAR_VALUES_TEXT)
            self.assertIsInstance(pieces, list, f"{pattern}: {pieces}")
            if pieces != expected:
                first = next(i for i, (a, b) in enumerate(zip(pieces + [None], expected + [None])) if a != b)
                self.fail(f"{pattern!r}: piece {first} is {pieces[first:first + 1]} in forge, "
                          f"{expected[first:first + 1]} in tokenizers (code point offsets)")

    def test_classes_on_every_code_point(self):
        answers = forge_split([{"pattern": f"(?:{p})+", "behavior": "removed", "text_file": self.all_scalar_values}
                               for p in CLASS_PATTERNS])
        for pattern, kept in zip(CLASS_PATTERNS, answers):
            self.assertIsInstance(kept, list, f"{pattern}: {kept}")
            members = oracle.ranges_of_indices(oracle.complement_runs(kept, len(oracle.SCALAR_VALUES)))
            expected = oracle.regex_class(pattern)
            if members != expected:
                first = next(i for i, (a, b) in enumerate(zip(members + [None], expected + [None])) if a != b)
                self.fail(f"{pattern!r}: range {first} is {members[first:first + 1]} in forge, "
                          f"{expected[first:first + 1]} in tokenizers")
        self.check_on_every_code_point([GENERAL_CATEGORY_RUNS, r"\b"], "isolated")
        print(f"{len(CLASS_PATTERNS)} classes, all general categories and \\b: the same on all "
              f"{len(oracle.SCALAR_VALUES)} code points as in tokenizers")

    def test_published_patterns_on_every_code_point(self):
        self.check_on_every_code_point(list(PUBLISHED_PATTERNS.values()), "isolated")
        print(f"{', '.join(PUBLISHED_PATTERNS)}: every code point split as tokenizers splits it")

    def test_published_patterns_on_unicode_texts(self):
        texts = unicode_texts.separator_texts() + unicode_texts.block_texts() + fixtures.TEST_TEXTS
        requests = [{"pattern": p, "behavior": b, "text": t} for p in PUBLISHED_PATTERNS.values() for b in BEHAVIORS
                    for t in texts]
        for request, pieces in zip(requests, forge_split(requests)):
            self.assertEqual(pieces, hf_split(request["pattern"], request["behavior"], request["text"]),
                             f"{request['pattern']!r} {request['behavior']} on {request['text']!r}")
        print(f"{len(PUBLISHED_PATTERNS)} published patterns x {len(BEHAVIORS)} behaviors x {len(texts)} texts "
              "(whitespace, format characters, Unicode 15/16 letters): pieces identical")

    def test_oniguruma_syntax(self):
        requests = [{"pattern": p, "behavior": b, "text": t} for p, t in SYNTAX_CASES for b in BEHAVIORS]
        for request, pieces in zip(requests, forge_split(requests)):
            self.assertEqual(pieces, hf_split(request["pattern"], request["behavior"], request["text"]),
                             f"{request['pattern']!r} {request['behavior']} on {request['text']!r}")
        print(f"{len(SYNTAX_CASES)} Oniguruma constructs x {len(BEHAVIORS)} behaviors: pieces identical")

    def test_untranslated_constructs_are_refused(self):
        answers = forge_split([{"pattern": p, "behavior": "isolated", "text": "a"} for p in UNSUPPORTED])
        for (pattern, construct), answer in zip(UNSUPPORTED.items(), answers):
            self.assertIsInstance(answer, str, f"{pattern!r} was not refused")
            self.assertIn(f"regex '{pattern}'", answer)
            self.assertIn(construct, answer)
        print(f"{len(UNSUPPORTED)} untranslated constructs refused, e.g.: {answers[0]}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
