"""forge's native SentencePiece tokenizer.model encoder against sentencepiece 0.2.3, token
for token.

Models are trained by sentencepiece itself (sentencepiece_fixtures.py) in the
configurations published models use: BPE like Llama 2 (identity normalization, byte
fallback, split digits, whitespace kept, "▁▁" pieces), nmt_nfkc, nfkc, nmt_nfkc_cf, a
custom rule TSV, remove_extra_whitespaces on and off, add_dummy_prefix off,
user-defined and control symbols, treat_whitespace_as_suffix, no whitespace split, and
unigram models; then edited the way published models differ from freshly trained ones
(UNUSED pieces, a denormalizer and unk_surface, appended pieces, tied scores, unescaped
whitespace). Each model encodes varied multilingual texts, random texts, invalid UTF-8, every
whitespace, format and control character (U+180E among them) and characters of the blocks
added in Unicode 14 to 17 (unicode_texts.py) through tools/forge_tokenize (encode_batch, checked against one-by-one encode
inside the tool); ids must equal sentencepiece's encode, decode must equal its decode,
and decoding arbitrary id sequences (control, unknown, byte and "▁" pieces in any order)
must equal its decode too.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402
import sentencepiece_fixtures as fixtures  # noqa: E402
import unicode_texts  # noqa: E402


def forge_tool(*args):
    return forge_test_util.run([forge_test_util.tool("forge_tokenize"), *args])


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


class SentencePieceModelVsReference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        cls.models = fixtures.train_models(cls.directory)
        cls.models.update(fixtures.edited_models(cls.models, cls.directory))
        cls.texts = (fixtures.TEXTS + fixtures.random_texts() + fixtures.INVALID_UTF8_TEXTS +
                     unicode_texts.separator_texts() + unicode_texts.block_texts())
        records = [{"hex": t.hex()} if isinstance(t, bytes) else {"text": t} for t in cls.texts]
        cls.texts_path = write_jsonl(os.path.join(cls.directory, "texts.jsonl"), records)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def reference(self, name):
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=self.models[name])

    def compare(self, name):
        reference = self.reference(name)
        lines = forge_tool(self.models[name], self.texts_path).stdout.splitlines()
        self.assertEqual(len(lines), len(self.texts))
        tokens = 0
        for text, line in zip(self.texts, lines):
            result = json.loads(line)
            expected = reference.encode(text)
            forge_pieces = [reference.id_to_piece(i) for i in result["ids"]]
            expected_pieces = [reference.id_to_piece(i) for i in expected]
            self.assertEqual(result["ids"], expected,
                             f"{name}: ids of {text!r}\n forge:         {forge_pieces}"
                             f"\n sentencepiece: {expected_pieces}")
            decoded = bytes.fromhex(result["decoded_hex"]).decode("utf-8")
            self.assertEqual(decoded, reference.decode(expected), f"{name}: decode of {text!r}")
            tokens += len(expected)
        print(f"{name}: {len(self.texts)} texts, {tokens} tokens identical to sentencepiece; decode identical")

    def test_bpe_models(self):
        for name in self.models:
            if name.startswith("bpe-"):
                self.compare(name)

    def test_unigram_models(self):
        for name in self.models:
            if name.startswith("unigram-"):
                self.compare(name)

    def test_vocab_size_bos_eos(self):
        for name, path in self.models.items():
            reference = self.reference(name)
            info = json.loads(forge_tool("--info", path).stdout)
            expected = {"vocab_size": reference.get_piece_size(),
                        "bos_id": reference.bos_id() if reference.bos_id() >= 0 else None,
                        "eos_id": reference.eos_id() if reference.eos_id() >= 0 else None}
            self.assertEqual(info, expected, name)
        print(f"{len(self.models)} models: vocab size, bos and eos as sentencepiece")

    def test_decode_arbitrary_ids(self):
        rng = random.Random(3)
        for name, path in self.models.items():
            reference = self.reference(name)
            size = reference.get_piece_size()
            special = [i for i in range(size) if reference.is_control(i) or reference.is_unknown(i)
                       or reference.is_byte(i) or reference.id_to_piece(i).startswith("\u2581")]
            sequences = [[], [0]] + [[rng.choice(special) if rng.random() < 0.5 else rng.randrange(size)
                                      for _ in range(rng.randint(1, 12))] for _ in range(300)]
            ids_path = write_jsonl(os.path.join(self.directory, "ids.jsonl"), [{"ids": s} for s in sequences])
            lines = forge_tool("--decode", path, ids_path).stdout.splitlines()
            for ids, line in zip(sequences, lines):
                decoded = bytes.fromhex(json.loads(line)["decoded_hex"]).decode("utf-8")
                self.assertEqual(decoded, reference.decode(ids), f"{name}: decode of {ids}")
        print(f"{len(self.models)} models: decode of 302 arbitrary id sequences each identical to sentencepiece")

    def test_invalid_utf8_becomes_replacement_characters(self):
        """sentencepiece's normalizer turns each byte that starts no valid UTF-8 character
        into U+FFFD, so decode cannot give the bytes back; forge matches it."""
        name = "bpe-llama2"
        reference = self.reference(name)
        path = write_jsonl(os.path.join(self.directory, "invalid.jsonl"),
                           [{"hex": t.hex()} for t in fixtures.INVALID_UTF8_TEXTS])
        for text, line in zip(fixtures.INVALID_UTF8_TEXTS, forge_tool(self.models[name], path).stdout.splitlines()):
            ids, decoded = json.loads(line)["ids"], bytes.fromhex(json.loads(line)["decoded_hex"]).decode("utf-8")
            self.assertEqual(ids, reference.encode(text))
            self.assertEqual(decoded, reference.decode(ids))
            self.assertIn("\ufffd", decoded)
        print(f"{len(fixtures.INVALID_UTF8_TEXTS)} invalid UTF-8 texts: ids as sentencepiece, decoded with U+FFFD "
              "where the invalid bytes were")

    def test_word_and_char_models_are_rejected(self):
        for model_type in ("word", "char"):
            path = fixtures.train(f"{model_type}-model", dict(model_type=model_type, vocab_size=400),
                                  self.directory)
            result = subprocess.run([forge_test_util.tool("forge_tokenize"), "--info", path],
                                    capture_output=True, text=True)
            self.assertEqual(result.returncode, 1)
            self.assertIn(f"{path}: trainer_spec.model_type is {model_type.upper()}; forge encodes SentencePiece "
                          "BPE and UNIGRAM models", result.stderr)
            print(result.stderr.strip())


if __name__ == "__main__":
    unittest.main(verbosity=2)
