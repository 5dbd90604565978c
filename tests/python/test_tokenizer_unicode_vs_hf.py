"""forge's tokenizers against Hugging Face tokenizers on the characters where regex engines
and Unicode versions disagree, token for token.

Tokenizers are trained by tokenizers itself (tokenizer_fixtures.py) on text in which letters,
marks and digits of blocks added in Unicode 14, 15.0, 15.1, 16.0 and 17.0 form words with
Latin letters and digits between every kind of separator (unicode_texts.py), so their merges
cross the boundaries that a class with another meaning would move: byte-level BPE in Llama 3's
layout (and its GPT-2 ByteLevel and Digits variants), SentencePiece-style BPE with a
Normalizer or a Metaspace pre-tokenizer, with single_word, lstrip/rstrip and normalized added
tokens. The texts hold every whitespace, format and control character (U+180E among them),
the new blocks' characters, the digits only the Digits pre-tokenizer's newer Unicode knows,
and the characters on which the single_word check and the regexes' \\w disagree, each next
to those added tokens. ids and decoded text must equal
tokenizers' encode(text, add_special_tokens=False) and decode. These texts would fail with
PCRE2's own \\s (U+180E) or its Unicode 14 tables (see test_regressions_would_be_caught).
"""
import copy
import json
import os
import shutil
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402
import tokenizer_fixtures as fixtures  # noqa: E402
import unicode_texts  # noqa: E402
from test_tokenizer_vs_hf import forge_encode  # noqa: E402


class UnicodeVsTokenizers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        lines = fixtures.corpus(1000) + unicode_texts.corpus_lines()
        byte_level = fixtures.train_byte_level(cls.directory, lines)
        cls.tokenizers = {"llama3-style": byte_level}
        for name, path in fixtures.byte_level_variants(byte_level, cls.directory).items():
            if name in ("gpt2-prefix-space", "digits"):
                cls.tokenizers[name] = path
        sentencepiece_style = fixtures.train_sentencepiece_style(cls.directory, lines)
        cls.tokenizers.update(sentencepiece_style)
        with open(sentencepiece_style["metaspace-first"], encoding="utf-8") as f:
            single_word = json.load(f)
        single_word["added_tokens"].append({
            "id": max(single_word["model"]["vocab"].values()) + 1, "content": "forge", "single_word": True,
            "lstrip": False, "rstrip": False, "normalized": False, "special": False})
        cls.tokenizers["metaspace-single-word"] = fixtures.save_json(
            single_word, os.path.join(cls.directory, "metaspace-single-word.json"))
        cls.texts = (unicode_texts.separator_texts() + unicode_texts.block_texts() + unicode_texts.digit_texts() +
                     unicode_texts.word_neighbour_texts())

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def test_ids_equal_tokenizers(self):
        from tokenizers import Tokenizer

        for name, path in self.tokenizers.items():
            reference = Tokenizer.from_file(path)
            tokens = 0
            for text, (ids, decoded) in zip(self.texts, forge_encode(path, self.texts, self.directory)):
                expected = reference.encode(text, add_special_tokens=False).ids
                self.assertEqual(ids, expected, f"{name}: ids of {text!r}")
                self.assertEqual(decoded.decode("utf-8"), reference.decode(expected, skip_special_tokens=False),
                                 f"{name}: decode of {text!r}")
                tokens += len(ids)
            print(f"{name}: {len(self.texts)} texts of separators, Unicode 14-17 characters and word "
                  f"neighbours, {tokens} tokens identical to tokenizers")

    def test_regressions_would_be_caught(self):
        """The texts tell forge's semantics from PCRE2's own: with \\s matching U+180E or
        with Unicode 14's \\p{L}, tokenizers' pre-tokenizer would cut them elsewhere."""
        from tokenizers import Regex, pre_tokenizers

        split = pre_tokenizers.Split(Regex(fixtures.LLAMA3_SPLIT_PATTERN), behavior="isolated")
        self.assertEqual([p for p, _ in split.pre_tokenize_str("  \u180e\u180e")], [" ", " \u180e\u180e"])
        garay = "x\U00010D4A\U00010D4B"  # letters of Unicode 16: one word, not a letter and punctuation
        self.assertEqual([p for p, _ in split.pre_tokenize_str(garay)], [garay])
        self.assertIn("  \u180e\u180e", self.texts)
        self.assertTrue(any(garay[1] in text for text in self.texts))
        print("texts include U+180E after spaces and Unicode 16 letters inside words")


if __name__ == "__main__":
    unittest.main(verbosity=2)
