"""forge's Megatron indexed dataset reader and writer against megatron-core's own.

Files built by megatron-core's IndexedDatasetBuilder must read back in forge exactly as
written (tools/forge_read_indexed prints what forge sees), and files written by forge's
IndexedDatasetWriter (tools/forge_write_indexed) must read back in megatron-core's
IndexedDataset identically, with an .idx byte-identical to megatron-core's for the same
documents.
"""

import json
import os
import subprocess
import tempfile
import unittest

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

TOOLS = os.environ.get("FORGE_TOOLS_DIR", "build/tests")
DTYPES = [numpy.uint16, numpy.int32, numpy.uint8, numpy.int64]


def random_documents(rng, dtype):
    """Documents as lists of sequences; some documents hold several sequences, some are
    empty sequences, token ids span the dtype's range."""
    high = min(numpy.iinfo(dtype).max, 2**31 - 1) + 1
    documents = []
    for _ in range(int(rng.integers(5, 40))):
        sequences = []
        for _ in range(int(rng.integers(1, 4))):
            length = int(rng.integers(0, 50))
            sequences.append(rng.integers(0, high, size=length).tolist())
        documents.append(sequences)
    documents.append([[high - 1, 0, high - 1]])
    return documents


def build_with_megatron(prefix, documents, dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i, sequences in enumerate(documents):
        if i % 2 == 0:
            flat = [t for s in sequences for t in s]
            builder.add_document(torch.tensor(flat, dtype=torch.int64), [len(s) for s in sequences])
        else:
            for s in sequences:
                builder.add_item(torch.tensor(s, dtype=torch.int64))
            builder.end_document()
    builder.finalize(prefix + ".idx")


def run_tool(name, *args):
    return subprocess.run([os.path.join(TOOLS, name), *args], capture_output=True, text=True)


class IndexedDatasetTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.rng = numpy.random.default_rng(1234)

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def test_forge_reads_megatron_files(self):
        for dtype in DTYPES:
            with self.subTest(dtype=dtype.__name__):
                documents = random_documents(self.rng, dtype)
                prefix = self.path("megatron_" + dtype.__name__)
                build_with_megatron(prefix, documents, dtype)
                result = run_tool("forge_read_indexed", prefix)
                self.assertEqual(result.returncode, 0, result.stderr)
                seen = json.loads(result.stdout)
                reference = IndexedDataset(prefix)
                self.assertEqual(seen["dtype"], dtype.__name__)
                self.assertEqual(seen["sequences"], [s for d in documents for s in d])
                self.assertEqual(seen["sequence_lengths"], reference.sequence_lengths.tolist())
                self.assertEqual(seen["sequence_pointers"], reference.index.sequence_pointers.tolist())
                self.assertEqual(seen["document_indices"], reference.document_indices.tolist())

    def test_megatron_reads_forge_files(self):
        for dtype in DTYPES:
            with self.subTest(dtype=dtype.__name__):
                documents = random_documents(self.rng, dtype)
                spec = self.path("documents.json")
                with open(spec, "w") as f:
                    json.dump({"dtype": dtype.__name__, "documents": documents}, f)
                prefix = self.path("forge_" + dtype.__name__)
                result = run_tool("forge_write_indexed", prefix, spec)
                self.assertEqual(result.returncode, 0, result.stderr)
                dataset = IndexedDataset(prefix)
                sequences = [s for d in documents for s in d]
                self.assertEqual(dataset.index.dtype, dtype)
                self.assertEqual(len(dataset), len(sequences))
                for i, s in enumerate(sequences):
                    self.assertEqual(dataset[i].dtype, dtype)
                    self.assertEqual(dataset[i].tolist(), s)
                boundaries = numpy.cumsum([0] + [len(d) for d in documents]).tolist()
                self.assertEqual(dataset.document_indices.tolist(), boundaries)

                reference = self.path("reference_" + dtype.__name__)
                build_with_megatron(reference, documents, dtype)
                for suffix in (".idx", ".bin"):
                    with open(prefix + suffix, "rb") as a, open(reference + suffix, "rb") as b:
                        self.assertEqual(a.read(), b.read(), suffix)

    def test_malformed_index_is_rejected_with_its_path(self):
        prefix = self.path("broken")
        build_with_megatron(prefix, [[[1, 2, 3]], [[4]]], numpy.uint16)
        with open(prefix + ".idx", "r+b") as f:
            f.seek(17)
            f.write(bytes([42]))
        result = run_tool("forge_read_indexed", prefix)
        self.assertEqual(result.returncode, 1)
        self.assertIn(prefix + ".idx", result.stderr)
        self.assertIn("unknown dtype code 42 at byte offset 17", result.stderr)


if __name__ == "__main__":
    unittest.main()
