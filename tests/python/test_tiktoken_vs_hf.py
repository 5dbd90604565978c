"""forge's reader of tiktoken BPE files (Meta's Llama 3 tokenizer.model) against tiktoken
and Hugging Face, token for token.

The file is a byte-level BPE trained by `tokenizers` on the Llama 3 split, written as
'<base64> <rank>' lines with ranks in token order (tokenizer_fixtures.train_tiktoken_file).
References on the same file: the `tiktoken` package (tiktoken.Encoding with Meta's pattern
and special tokens numbered after the ranks, allowed_special="all") and the tokenizer.json
transformers' TikTokenConverter converts from it, run by `tokenizers` (special tokens are
added tokens there, matched in any text). forge's ids must equal both on varied
multilingual texts, texts holding special-token strings included; decode must give the
text back; forge prep with the file must write what megatron-core's builder writes; and
malformed files must fail naming file:line.
"""
import json
import os
import shutil
import subprocess
import sys
import unittest

os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken otherwise caches even local files by path

import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402
import tokenizer_fixtures as fixtures  # noqa: E402
from test_tokenizer_vs_hf import forge_encode, forge_info  # noqa: E402

# Meta's Llama 3 special tokens (meta-llama/llama3, llama/tokenizer.py), numbered after the ranks.
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]

# Llama 3.1's, as Hugging Face's tokenizer.json holds them (transformers'
# convert_llama_weights_to_hf.py, DEFAULT_LLAMA_SPECIAL_TOKENS["3.1"]).
LLAMA31_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(3, 256 - 8)]

SPECIAL_TOKEN_TEXTS = [
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
    "text <|reserved_special_token_17|> and <|reserved_special_token_250|>, <|reserved_special_token_251|>",
    "<|python_tag|>print(1)<|eom_id|> <|finetune_right_pad_id|><|step_id|><|image|>",
    "partial <|begin_of_text| and <|eot_id|<|eot_id|>>> <|END_OF_TEXT|>",
    "<|end_of_text|>",
]


def texts():
    long_runs = "word " * 3000 + " " * 30000 + "x" * 30000 + "\n" * 100
    return fixtures.TEST_TEXTS + SPECIAL_TOKEN_TEXTS + fixtures.corpus(lines=500, seed=17) + [long_runs]


def references(path, special_tokens):
    """(tiktoken.Encoding, tokenizers.Tokenizer converted by TikTokenConverter) for `path`."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = load_tiktoken_bpe(path)
    encoding = tiktoken.Encoding(name="llama3-test", pat_str=fixtures.LLAMA3_SPLIT_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={t: len(ranks) + i for i, t in enumerate(special_tokens)})
    converted = TikTokenConverter(vocab_file=path, pattern=fixtures.LLAMA3_SPLIT_PATTERN,
                                  extra_special_tokens=special_tokens).converted()
    return encoding, converted


class TiktokenVsReference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        cls.path = fixtures.train_tiktoken_file(cls.directory)
        cls.encoding, cls.converted = references(cls.path, LLAMA3_SPECIAL_TOKENS)
        cls.converted_json = os.path.join(cls.directory, "converted", "tokenizer.json")
        os.makedirs(os.path.dirname(cls.converted_json))
        cls.converted.save(cls.converted_json)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def compare(self, name, path, encoding, converted, cases):
        results = forge_encode(path, cases, self.directory)
        tokens = 0
        for text, (ids, decoded) in zip(cases, results):
            by_tiktoken = encoding.encode(text, allowed_special="all")
            by_tokenizer_json = converted.encode(text, add_special_tokens=False).ids
            self.assertEqual(ids, by_tokenizer_json, f"{name}: ids of {text[:80]!r} vs the converted tokenizer.json")
            self.assertEqual(ids, by_tiktoken, f"{name}: ids of {text[:80]!r} vs tiktoken")
            self.assertEqual(decoded, text.encode("utf-8"), f"{name}: decode of {text[:80]!r}")
            self.assertEqual(decoded, encoding.decode_bytes(ids), f"{name}: decode of {text[:80]!r} vs tiktoken")
            tokens += len(ids)
        return tokens

    def test_ids_equal_tiktoken_and_converted_tokenizer_json(self):
        import tiktoken
        import tokenizers

        cases = texts()
        tokens = self.compare("llama3", self.path, self.encoding, self.converted, cases)
        print(f"tiktoken file ({self.encoding.max_token_value + 1 - 256} ranks): {len(cases)} texts, {tokens} tokens "
              f"identical to tiktoken {tiktoken.__version__} and to its tokenizer.json converted by transformers, "
              f"run by tokenizers {tokenizers.__version__}; decode gives the text back")
        from_json = forge_encode(self.converted_json, cases, self.directory)
        from_file = forge_encode(self.path, cases, self.directory)
        self.assertEqual([ids for ids, _ in from_json], [ids for ids, _ in from_file])
        print("forge on the converted tokenizer.json: the same ids as on the tiktoken file")

    def test_special_tokens_and_info(self):
        info = forge_info(self.path)
        ranks = self.encoding.max_token_value + 1 - 256
        self.assertEqual(info, {"vocab_size": self.encoding.n_vocab, "bos_id": ranks, "eos_id": ranks + 1})
        self.assertEqual(info["vocab_size"], self.converted.get_vocab_size(with_added_tokens=True))
        ids = forge_encode(self.path, ["<|eot_id|>", "<|reserved_special_token_250|>"], self.directory)
        self.assertEqual([i for i, _ in ids], [[ranks + 9], [ranks + 255]])
        print(f"vocab {info['vocab_size']} = {ranks} ranks + 256 special tokens; BOS {ranks}, EOS {ranks + 1}, "
              f"<|eot_id|> {ranks + 9}, as Meta's tokenizer.py numbers them")

    def test_llama31_names_with_scaled_rope_params(self):
        directory = os.path.join(self.directory, "llama31-original")
        os.makedirs(directory, exist_ok=True)
        path = shutil.copy(self.path, os.path.join(directory, "tokenizer.model"))
        with open(os.path.join(directory, "params.json"), "w") as f:
            json.dump({"dim": 64, "rope_theta": 500000.0, "use_scaled_rope": True, "vocab_size": 2003}, f)
        encoding, converted = references(path, LLAMA31_SPECIAL_TOKENS)
        cases = SPECIAL_TOKEN_TEXTS + fixtures.TEST_TEXTS
        tokens = self.compare("llama3.1", path, encoding, converted, cases)
        print(f"params.json with use_scaled_rope: {len(cases)} texts, {tokens} tokens identical with Llama 3.1's "
              f"special-token names")

    def test_invalid_utf8_round_trips(self):
        results = forge_encode(self.path, fixtures.INVALID_UTF8_TEXTS, self.directory)
        for text, (ids, decoded) in zip(fixtures.INVALID_UTF8_TEXTS, results):
            self.assertTrue(ids)
            self.assertEqual(decoded, text)
        print(f"{len(fixtures.INVALID_UTF8_TEXTS)} invalid UTF-8 texts round-trip byte for byte")

    def test_prep_with_tiktoken_file_identical_to_megatron(self):
        cases = [t for t in texts() if t]
        inputs = os.path.join(self.directory, "docs.jsonl")
        with open(inputs, "w", encoding="utf-8") as f:
            for text in cases:
                f.write(json.dumps({"text": text}) + "\n")
        prefix = os.path.join(self.directory, "forge_docs")
        result = subprocess.run([forge_test_util.forge_bin(), "prep", "--input", inputs, "--tokenizer", self.path,
                                 "--output-prefix", prefix], capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        reference = os.path.join(self.directory, "megatron_docs")
        eos = self.encoding.max_token_value + 1 - 256 + 1
        builder = IndexedDatasetBuilder(reference + ".bin", dtype=DType.optimal_dtype(self.encoding.n_vocab))
        for text in cases:
            ids = self.encoding.encode(text, allowed_special="all") + [eos]
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        builder.finalize(reference + ".idx")
        for suffix in (".bin", ".idx"):
            with open(prefix + suffix, "rb") as a, open(reference + suffix, "rb") as b:
                self.assertEqual(a.read(), b.read(), suffix)
        print(f"forge prep with the tiktoken file: {len(cases)} documents byte-identical to megatron-core's builder "
              f"fed tiktoken's ids + EOS {eos}")

    def test_malformed_files_name_file_and_line(self):
        with open(self.path, encoding="ascii") as f:
            lines = f.read().splitlines()
        broken = {
            "bad-base64": (lines[:16] + ["IQ=* 16"] + lines[17:], ":17:", "is not base64"),
            "missing-rank": (lines[:16] + [lines[16].split()[0]] + lines[17:], ":17:",
                             "expected '<base64 of the token bytes> <rank>'"),
            "duplicate-rank": (lines[:16] + [lines[16].split()[0] + " 15"] + lines[17:], ":17:",
                               "rank 15 again (first on line 16)"),
            "gap": (lines[:300] + lines[301:], ": rank 300 is missing", f"from 0 to {len(lines) - 1}"),
        }
        for name, (content, where, what) in broken.items():
            path = os.path.join(self.directory, f"{name}.model")
            with open(path, "w", encoding="ascii") as f:
                f.write("\n".join(content) + "\n")
            result = subprocess.run([forge_test_util.tool("forge_tokenize"), "--info", path], capture_output=True,
                                    text=True)
            self.assertEqual(result.returncode, 1, name)
            self.assertIn(path + where, result.stderr, name)
            self.assertIn(what, result.stderr, name)
            print(f"{name}: {result.stderr.strip()}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
