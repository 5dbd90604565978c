"""The committed FP8-convergence corpus (data/corpora/web-bible) and its tokenizer.

forge's load_tokenizer (tools/forge_tokenize, encode_batch checked against one-by-one encode
inside the tool) must encode every chapter of the corpus exactly as Hugging Face tokenizers
does, and decode it back; the tokenizer must be what scripts/make-bible-tokenizer trains
from the corpus, byte for byte (the README's regeneration command); its vocabulary and EOS
must be the ones configs/models/llama-150m.yaml and `forge prep` rely on. Nothing is
downloaded.
"""
import filecmp
import json
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402

CORPUS_DIR = os.path.join("data", "corpora", "web-bible")


def corpus_path(name):
    return os.path.join(forge_test_util.source_dir(), CORPUS_DIR, name)


def read_documents():
    import zstandard

    with open(corpus_path("web-bible.jsonl.zst"), "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read()
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


class WebBibleCorpus(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        cls.documents = read_documents()
        cls.texts = [d["text"] for d in cls.documents]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def test_corpus_is_real_chapters(self):
        self.assertEqual(len(self.documents), 1388)
        self.assertEqual(len({(d["book"], d["chapter"]) for d in self.documents}), 1388)
        self.assertEqual(sum(len(t.split()) for t in self.texts), 908616)
        for d in self.documents:
            self.assertTrue(d["text"].strip(), f"{d['book']} {d['chapter']} is empty")
            self.assertNotIn("<", d["text"], f"{d['book']} {d['chapter']} holds markup")
        genesis = next(d["text"] for d in self.documents if (d["book"], d["chapter"]) == ("Genesis", 1))
        self.assertTrue(genesis.startswith("In the beginning, God created the heavens and the earth."))

    def test_forge_encodes_the_corpus_as_tokenizers(self):
        from tokenizers import Tokenizer

        path = corpus_path("tokenizer.json")
        reference = Tokenizer.from_file(path)
        inputs = os.path.join(self.directory, "texts.jsonl")
        with open(inputs, "w", encoding="utf-8") as f:
            for text in self.texts:
                f.write(json.dumps({"text": text}) + "\n")
        result = forge_test_util.run([forge_test_util.tool("forge_tokenize"), path, inputs])
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        self.assertEqual(len(lines), len(self.texts))
        expected = reference.encode_batch(self.texts, add_special_tokens=False)
        tokens = 0
        for doc, line, want in zip(self.documents, lines, expected):
            where = f"{doc['book']} {doc['chapter']}"
            self.assertEqual(line["ids"], want.ids, f"ids of {where}")
            self.assertEqual(bytes.fromhex(line["decoded_hex"]).decode("utf-8"), doc["text"], f"decode of {where}")
            tokens += len(want.ids)
        self.assertEqual(tokens, 1158809)
        print(f"{len(self.texts)} chapters, {tokens} tokens identical to tokenizers; decode gives the text back")

    def test_vocabulary_and_eos_match_the_model(self):
        import yaml

        path = corpus_path("tokenizer.json")
        info = json.loads(forge_test_util.run([forge_test_util.tool("forge_tokenize"), "--info", path]).stdout)
        self.assertEqual(info["eos_id"], 0)
        self.assertIsNone(info["bos_id"])
        with open(os.path.join(forge_test_util.source_dir(), "configs", "models", "llama-150m.yaml")) as f:
            model = yaml.safe_load(f)
        self.assertEqual(info["vocab_size"], model["vocab_size"])

    def test_tokenizer_regenerates_byte_for_byte(self):
        output = os.path.join(self.directory, "tokenizer.json")
        script = os.path.join(forge_test_util.source_dir(), "scripts", "make-bible-tokenizer")
        forge_test_util.run([sys.executable, script, corpus_path("web-bible.jsonl.zst"), output])
        self.assertTrue(filecmp.cmp(output, corpus_path("tokenizer.json"), shallow=False),
                        "scripts/make-bible-tokenizer no longer reproduces the committed tokenizer.json")

    def test_prep_counts_one_eos_per_chapter(self):
        prefix = os.path.join(self.directory, "web-bible")
        result = forge_test_util.run([forge_test_util.forge_bin(), "prep", "--input", corpus_path("web-bible.jsonl.zst"),
                                      "--tokenizer", corpus_path("tokenizer.json"), "--output-prefix", prefix,
                                      "--workers", "2"])
        self.assertIn("1388 documents (0 without tokens), 1160197 tokens (uint16)", result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
