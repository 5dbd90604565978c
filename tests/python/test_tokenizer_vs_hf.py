"""forge's tokenizers against the reference libraries, token for token.

Tokenizer files are trained by Hugging Face `tokenizers` and `sentencepiece` themselves
(tokenizer_fixtures.py): byte-level BPE in Llama 3's layout and variants (string merges,
ignore_merges off, GPT-2 pre-tokenizer, Digits), SentencePiece-style BPE with byte
fallback in Llama 2's layout and Metaspace variants, and a sentencepiece tokenizer.model.
tools/forge_tokenize encodes varied multilingual texts with encode_batch (checked against
one-by-one encode inside the tool); ids must equal tokenizers' encode(text,
add_special_tokens=False).ids (sentencepiece's encode for the .model) and decode must equal
the library's decode. Invalid UTF-8, which the libraries cannot take, must round-trip
through forge's encode and decode byte for byte.
"""
import json
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402
import tokenizer_fixtures as fixtures  # noqa: E402


def forge_encode(tokenizer_path, texts, directory):
    """(ids, decoded bytes) per text as forge computes them."""
    inputs = os.path.join(directory, "texts.jsonl")
    with open(inputs, "w", encoding="utf-8") as f:
        for text in texts:
            record = {"hex": text.hex()} if isinstance(text, bytes) else {"text": text}
            f.write(json.dumps(record) + "\n")
    result = forge_test_util.run([forge_test_util.tool("forge_tokenize"), tokenizer_path, inputs])
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    return [(line["ids"], bytes.fromhex(line["decoded_hex"])) for line in lines]


def forge_info(tokenizer_path):
    return json.loads(forge_test_util.run([forge_test_util.tool("forge_tokenize"), "--info", tokenizer_path]).stdout)


class TokenizerVsReference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        cls.byte_level = fixtures.train_byte_level(cls.directory)
        cls.byte_level_variants = fixtures.byte_level_variants(cls.byte_level, cls.directory)
        cls.sentencepiece_style = fixtures.train_sentencepiece_style(cls.directory)
        cls.sentencepiece_model = fixtures.train_sentencepiece_model(cls.directory)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def compare_with_hf(self, name, path):
        from tokenizers import Tokenizer

        reference = Tokenizer.from_file(path)
        results = forge_encode(path, fixtures.TEST_TEXTS, self.directory)
        tokens = 0
        for text, (ids, decoded) in zip(fixtures.TEST_TEXTS, results):
            expected = reference.encode(text, add_special_tokens=False).ids
            self.assertEqual(ids, expected, f"{name}: ids of {text!r}")
            expected_text = reference.decode(expected, skip_special_tokens=False)
            self.assertEqual(decoded.decode("utf-8"), expected_text, f"{name}: decode of {text!r}")
            tokens += len(ids)
        print(f"{name}: {len(fixtures.TEST_TEXTS)} texts, {tokens} tokens identical to tokenizers "
              f"{__import__('tokenizers').__version__}; decode identical")
        return reference

    def check_invalid_utf8_round_trip(self, name, path):
        results = forge_encode(path, fixtures.INVALID_UTF8_TEXTS, self.directory)
        for text, (ids, decoded) in zip(fixtures.INVALID_UTF8_TEXTS, results):
            self.assertTrue(ids, f"{name}: {text!r} gave no tokens")
            self.assertEqual(decoded, text, f"{name}: invalid UTF-8 {text!r} did not round-trip")
        print(f"{name}: {len(fixtures.INVALID_UTF8_TEXTS)} invalid UTF-8 texts round-trip byte for byte")

    def test_llama3_style_byte_level(self):
        reference = self.compare_with_hf("llama3-style", self.byte_level)
        info = forge_info(self.byte_level)
        self.assertEqual(info["bos_id"], reference.token_to_id("<|begin_of_text|>"))
        self.assertEqual(info["eos_id"], reference.token_to_id("<|end_of_text|>"))
        self.assertEqual(info["vocab_size"], reference.get_vocab_size(with_added_tokens=True))
        print(f"llama3-style: bos {info['bos_id']}, eos {info['eos_id']}, vocab {info['vocab_size']} as tokenizers")
        self.check_invalid_utf8_round_trip("llama3-style", self.byte_level)
        digits = forge_encode(self.byte_level, ["1234567"], self.directory)[0][0]
        self.assertEqual([reference.id_to_token(i) for i in digits], ["123", "456", "7"])

    def test_byte_level_variants(self):
        for name, path in self.byte_level_variants.items():
            self.compare_with_hf(name, path)

    def test_sentencepiece_style(self):
        for name, path in self.sentencepiece_style.items():
            reference = self.compare_with_hf(name, path)
            self.check_invalid_utf8_round_trip(name, path)
        info = forge_info(self.sentencepiece_style["llama2-style"])
        self.assertEqual((info["bos_id"], info["eos_id"]), (1, 2))

    def test_sentencepiece_model(self):
        import sentencepiece

        reference = sentencepiece.SentencePieceProcessor(model_file=self.sentencepiece_model)
        results = forge_encode(self.sentencepiece_model, fixtures.TEST_TEXTS, self.directory)
        tokens = 0
        for text, (ids, decoded) in zip(fixtures.TEST_TEXTS, results):
            expected = reference.encode(text)
            self.assertEqual(ids, expected, f"tokenizer.model: ids of {text!r}")
            self.assertEqual(decoded.decode("utf-8"), reference.decode(expected), f"tokenizer.model: decode of {text!r}")
            tokens += len(ids)
        info = forge_info(self.sentencepiece_model)
        self.assertEqual((info["bos_id"], info["eos_id"], info["vocab_size"]),
                         (reference.bos_id(), reference.eos_id(), reference.get_piece_size()))
        print(f"tokenizer.model: {len(fixtures.TEST_TEXTS)} texts, {tokens} tokens identical to sentencepiece "
              f"{sentencepiece.__version__}; decode, bos, eos, vocab size identical")

    def test_directory_prefers_tokenizer_json(self):
        directory = os.path.join(self.directory, "model-dir")
        os.makedirs(directory, exist_ok=True)
        shutil.copy(self.sentencepiece_model, os.path.join(directory, "tokenizer.model"))
        self.assertEqual(forge_info(directory)["vocab_size"], forge_info(self.sentencepiece_model)["vocab_size"])
        shutil.copy(self.byte_level, os.path.join(directory, "tokenizer.json"))
        self.assertEqual(forge_info(directory), forge_info(self.byte_level))
        print("directory: tokenizer.model alone is loaded; tokenizer.json is preferred when both are present")

    def test_unsupported_component_is_named(self):
        with open(self.byte_level, encoding="utf-8") as f:
            config = json.load(f)
        config["pre_tokenizer"] = {"type": "Whitespace"}
        path = fixtures.save_json(config, os.path.join(self.directory, "whitespace.json"))
        result = subprocess.run([forge_test_util.tool("forge_tokenize"), "--info", path], capture_output=True, text=True)
        self.assertEqual(result.returncode, 1)
        self.assertIn("whitespace.json: pre_tokenizer: type 'Whitespace' is not supported", result.stderr)
        print("unsupported pre_tokenizer rejected:", result.stderr.strip())


if __name__ == "__main__":
    unittest.main(verbosity=2)
