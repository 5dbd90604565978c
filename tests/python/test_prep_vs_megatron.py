"""`forge prep` against the reference implementations: documents in JSON Lines (plain,
.gz, .zst) and text files are tokenized by forge with a tokenizer.json trained by Hugging
Face `tokenizers`, and the result is read back with megatron-core's own IndexedDataset.
Every document must hold exactly tokenizers' encode(text, add_special_tokens=False).ids
plus EOS, and the files must be byte-identical to what megatron-core's
IndexedDatasetBuilder writes when driven the way Megatron's tools/preprocess_data.py
drives it (--append-eod, DType.optimal_dtype). The same holds with a SentencePiece
tokenizer.model trained by sentencepiece (ids from sentencepiece's encode). Lines Python's
json.dumps writes beyond strict JSON (NaN, Infinity, numbers beyond double range, lone
surrogates, duplicate keys) are read as Megatron's json.loads reads them. Also: failures keep
an existing dataset and name file:line, and a blend of prepared datasets trains."""
import gzip
import json
import os
import subprocess
import sys
import unittest
from types import SimpleNamespace

import numpy
import torch
import zstandard
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sentencepiece_fixtures  # noqa: E402
import tokenizer_fixtures  # noqa: E402
from forge_test_util import forge_bin, scratch_dir  # noqa: E402


def forge(*args):
    return subprocess.run([forge_bin(), *map(str, args)], capture_output=True, text=True)


def documents():
    texts = list(tokenizer_fixtures.TEST_TEXTS) + tokenizer_fixtures.corpus(lines=600, seed=5)
    texts.insert(3, "")
    return texts


def write_jsonl(path, texts, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}, ensure_ascii=i % 2 == 0) + "\n")


def write_jsonl_zst(path, texts):
    with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as z:
        for i, text in enumerate(texts):
            z.write((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode())


def python_json_lines(texts):
    """JSON Lines as Python writes them beyond strict JSON, around each text: NaN, Infinity,
    -Infinity and a 400-digit integer (json.dumps writes them), a lone surrogate escape in
    another field (ensure_ascii), a decoy "text" before the real one (json.loads keeps the
    last), exponents beyond double range and nesting."""
    lines = []
    for i, text in enumerate(texts):
        record = {"id": i, "score": float("nan"), "max": float("inf"), "min": float("-inf"), "big": 10 ** (400 + i % 7),
                  "text": text}
        if i % 3 == 0:
            record["title"] = "lone \ud800 surrogate"
        line = json.dumps(record, ensure_ascii=i % 3 == 0 or i % 2 == 0)
        if i % 4 == 1:
            line = '{"text": "a decoy: the last duplicate key wins", ' + line[1:]
        if i % 5 == 2:
            line = line[:-1] + ', "huge": 1e400, "tiny": -1e999, "deep": [[{"a": [NaN, -Infinity]}], {}]}'
        lines.append(line)
    return lines


def megatron_reference(prefix, texts, tokenizer, eos, append_eod=True):
    """What preprocess_data.py writes for these documents: per document the ids, EOS
    appended when the document has any ids, one sequence (none for an empty document)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(tokenizer.get_vocab_size()))
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        lengths = [len(ids)] if ids else []
        if ids and append_eod:
            ids = ids + [eos]
            lengths[-1] += 1
        builder.add_document(torch.tensor(ids, dtype=torch.int64), lengths)
    builder.finalize(prefix + ".idx")


class SentencePieceReference:
    """A sentencepiece model behind the part of tokenizers' interface megatron_reference uses."""

    def __init__(self, path):
        import sentencepiece

        self.processor = sentencepiece.SentencePieceProcessor(model_file=path)

    def get_vocab_size(self):
        return self.processor.get_piece_size()

    def encode(self, text, add_special_tokens=False):
        return SimpleNamespace(ids=self.processor.encode(text))


def read_documents(prefix):
    data = IndexedDataset(prefix)
    bounds = data.document_indices
    return data, [[t for s in range(bounds[d], bounds[d + 1]) for t in data[s].tolist()]
                  for d in range(len(bounds) - 1)]


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


class PrepVsMegatron(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = scratch_dir()
        cls.tokenizer_path = tokenizer_fixtures.train_byte_level(cls.dir)
        cls.tokenizer = Tokenizer.from_file(cls.tokenizer_path)
        cls.eos = cls.tokenizer.token_to_id("<|end_of_text|>")
        texts = documents()
        third = len(texts) // 3
        cls.parts = [texts[:third], texts[third:2 * third], texts[2 * third:]]
        cls.inputs = [os.path.join(cls.dir, n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst")]
        write_jsonl(cls.inputs[0], cls.parts[0])
        write_jsonl(cls.inputs[1], cls.parts[1], opener=gzip.open)
        write_jsonl_zst(cls.inputs[2], cls.parts[2])
        cls.texts = texts

    def prep(self, prefix, *extra, inputs=None, tokenizer=None):
        args = ["prep", "--tokenizer", tokenizer or self.tokenizer_path, "--output-prefix", prefix, *extra]
        for path in inputs or self.inputs:
            args += ["--input", path]
        return forge(*args)

    def test_documents_equal_tokenizers_ids_plus_eos(self):
        prefix = os.path.join(self.dir, "out", "corpus")
        result = self.prep(prefix, "--workers", "2")
        self.assertEqual(result.returncode, 0, result.stderr)
        print(result.stdout.strip())
        data, docs = read_documents(prefix)
        self.assertEqual(data.index.dtype, numpy.uint16)
        self.assertEqual(len(docs), len(self.texts))
        checked_tokens = 0
        for i, (text, doc) in enumerate(zip(self.texts, docs)):
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            expected = ids + [self.eos] if ids else []
            self.assertEqual(doc, expected, f"document {i}: {text[:60]!r}")
            checked_tokens += len(doc)
        print(f"{len(docs)} documents, {checked_tokens} tokens equal to tokenizers' ids + EOS {self.eos}")
        self.assertIn(f"{len(docs)} documents", result.stdout)

    def test_files_identical_to_megatron_builder(self):
        prefix = os.path.join(self.dir, "forge_same")
        result = self.prep(prefix)
        self.assertEqual(result.returncode, 0, result.stderr)
        reference = os.path.join(self.dir, "megatron_same")
        megatron_reference(reference, self.texts, self.tokenizer, self.eos)
        for suffix in (".bin", ".idx"):
            self.assertEqual(read_bytes(prefix + suffix), read_bytes(reference + suffix), suffix)
        print(f"forge prep .bin/.idx byte-identical to megatron-core's IndexedDatasetBuilder "
              f"({os.path.getsize(prefix + '.bin')} + {os.path.getsize(prefix + '.idx')} bytes)")

    def test_text_per_line_without_eod_sentencepiece_style(self):
        tokenizer_path = tokenizer_fixtures.train_sentencepiece_style(self.dir)["llama2-style"]
        tokenizer = Tokenizer.from_file(tokenizer_path)
        lines = [t for t in tokenizer_fixtures.corpus(lines=200, seed=9) if t and "\n" not in t and "\r" not in t]
        path = os.path.join(self.dir, "lines.txt.zst")
        with open(path, "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
        prefix = os.path.join(self.dir, "lines")
        result = self.prep(prefix, "--text-per-line", "--no-append-eod", inputs=[path], tokenizer=tokenizer_path)
        self.assertEqual(result.returncode, 0, result.stderr)
        reference = os.path.join(self.dir, "lines_megatron")
        megatron_reference(reference, lines, tokenizer, None, append_eod=False)
        for suffix in (".bin", ".idx"):
            self.assertEqual(read_bytes(prefix + suffix), read_bytes(reference + suffix), suffix)
        print(f"{len(lines)} lines of a .txt.zst, no EOD, Llama 2-style tokenizer: identical to megatron-core")

    def test_python_json_extensions_identical_to_megatron(self):
        lines = python_json_lines(self.texts)
        path = os.path.join(self.dir, "python.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        read_by_python = [json.loads(line)["text"] for line in lines]
        self.assertEqual(read_by_python, self.texts)
        prefix = os.path.join(self.dir, "forge_python")
        result = self.prep(prefix, inputs=[path])
        self.assertEqual(result.returncode, 0, result.stderr)
        reference = os.path.join(self.dir, "megatron_python")
        megatron_reference(reference, read_by_python, self.tokenizer, self.eos)
        for suffix in (".bin", ".idx"):
            self.assertEqual(read_bytes(prefix + suffix), read_bytes(reference + suffix), suffix)
        print(f"{len(lines)} lines with NaN, Infinity, 400-digit integers, 1e400, lone surrogates and duplicate keys "
              f"outside the text: identical to megatron-core on what json.loads reads")

    def test_lone_surrogate_in_text_is_a_bad_line(self):
        lines = [json.dumps({"text": t}) for t in ["before", "a \ud800 lone surrogate", "after \U0001F600"]]
        with self.assertRaises(TypeError):
            self.tokenizer.encode(json.loads(lines[1])["text"], add_special_tokens=False)
        path = os.path.join(self.dir, "surrogate.jsonl")
        with open(path, "w", encoding="ascii") as f:
            f.write("\n".join(lines) + "\n")
        result = self.prep(os.path.join(self.dir, "surrogate"), inputs=[path])
        print(result.stderr.strip())
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f"{path}:2:", result.stderr)
        self.assertIn("lone surrogate", result.stderr)
        prefix = os.path.join(self.dir, "surrogate_skipped")
        skipped = self.prep(prefix, "--skip-bad-lines", inputs=[path])
        self.assertEqual(skipped.returncode, 0, skipped.stderr)
        self.assertIn("1 lines skipped", skipped.stdout)
        reference = os.path.join(self.dir, "surrogate_megatron")
        megatron_reference(reference, ["before", "after \U0001F600"], self.tokenizer, self.eos)
        for suffix in (".bin", ".idx"):
            self.assertEqual(read_bytes(prefix + suffix), read_bytes(reference + suffix), suffix)
        print("a lone surrogate in the text (tokenizers raises on it in Megatron) is a bad line; the others match")

    def test_files_identical_to_megatron_builder_with_tokenizer_model(self):
        name, options = sentencepiece_fixtures.BPE_CONFIGS[0]
        tokenizer_path = sentencepiece_fixtures.train(name, options, self.dir)
        tokenizer = SentencePieceReference(tokenizer_path)
        prefix = os.path.join(self.dir, "forge_sentencepiece")
        result = self.prep(prefix, "--workers", "2", tokenizer=tokenizer_path)
        self.assertEqual(result.returncode, 0, result.stderr)
        reference = os.path.join(self.dir, "megatron_sentencepiece")
        megatron_reference(reference, self.texts, tokenizer, tokenizer.processor.eos_id())
        for suffix in (".bin", ".idx"):
            self.assertEqual(read_bytes(prefix + suffix), read_bytes(reference + suffix), suffix)
        print(f"forge prep with a {name} tokenizer.model: .bin/.idx byte-identical to megatron-core's builder fed "
              f"sentencepiece's ids ({os.path.getsize(prefix + '.bin')} bytes)")

    def test_bad_line_names_file_and_line_and_keeps_existing_dataset(self):
        prefix = os.path.join(self.dir, "kept")
        self.assertEqual(self.prep(prefix).returncode, 0)
        before = read_bytes(prefix + ".bin"), read_bytes(prefix + ".idx")
        bad = os.path.join(self.dir, "bad.jsonl.gz")
        with gzip.open(bad, "wt") as f:
            f.write('{"text": "fine"}\n' * 5000 + '{"text": "fine"\n')
        result = self.prep(prefix, inputs=[self.inputs[0], bad])
        print(result.stderr.strip())
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f"{bad}:5001:", result.stderr)
        self.assertEqual((read_bytes(prefix + ".bin"), read_bytes(prefix + ".idx")), before)
        self.assertEqual(sorted(n for n in os.listdir(self.dir) if n.startswith("kept")), ["kept.bin", "kept.idx"])

        skipped = self.prep(os.path.join(self.dir, "skipped"), "--skip-bad-lines", inputs=[bad])
        self.assertEqual(skipped.returncode, 0, skipped.stderr)
        self.assertIn("5000 documents", skipped.stdout)
        self.assertIn("1 lines skipped", skipped.stdout)

    def test_blend_of_prepared_datasets_trains(self):
        prefixes = []
        for i, part in enumerate(self.parts[:2]):
            prefix = os.path.join(self.dir, f"blend{i}")
            self.assertEqual(self.prep(prefix, inputs=[self.inputs[i]]).returncode, 0)
            prefixes.append(prefix)
        run_dir = os.path.join(self.dir, "run")
        blend = f"0.3 {prefixes[0]} 0.7 {prefixes[1]}"
        result = forge("train", "--data.source", "indexed", "--data.blend", blend, "--model.vocab_size", "1600",
                       "--training.seq_len", "32", "--training.steps", "3", "--eval.interval", "3",
                       "--eval.steps", "1", "--logging.run_dir", run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(os.path.join(run_dir, "config.yaml")) as f:
            self.assertIn("blend0", f.read())
        missing = forge("train", "--data.source", "indexed", "--data.blend", f"0.3 {prefixes[0]} 0.7 /nonexistent/x",
                        "--model.vocab_size", "1600", "--logging.run_dir", os.path.join(self.dir, "run2"))
        print(missing.stderr.strip())
        self.assertNotEqual(missing.returncode, 0)
        self.assertIn("/nonexistent/x", missing.stderr)
        odd = forge("train", "--data.source", "indexed", "--data.blend", f"0.3 {prefixes[0]} 0.7",
                    "--logging.run_dir", os.path.join(self.dir, "run3"))
        self.assertNotEqual(odd.returncode, 0)
        self.assertIn("data.blend", odd.stderr)


if __name__ == "__main__":
    unittest.main()
