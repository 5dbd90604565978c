""".npy files as numpy writes them, read by forge (data/npy_array.h, data/npy_records.h,
data/govreport_dataset.h):
  - integer and bool arrays of every supported dtype, both byte orders, 0-d/1-d/2-d/empty,
    format versions 1.0, 2.0 and 3.0: forge reads numpy's values exactly; Fortran order,
    floats, truncated and padded files are refused naming the file;
  - object arrays of dicts as the MLPerf Llama 2 70B LoRA convert_dataset.py writes them
    (numpy.save of [{"input_ids": ndarray, "loss_mask": [0/1...], "seq_start_id": [0]}]), in
    pickle protocols 3 (numpy 1's numpy.save, also with its module name)
    and 4 (numpy 2's): forge decodes the same records,
    and a pickle naming any other global is refused without being run;
  - data.source govreport_npy: samples carry the reference's loss mask, bad records are
    refused naming the file, record and key, and forge train learns from tiny stand-in
    train.npy / validation.npy files of the same schema, evaluating on the validation file.
"""
import collections
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import unittest

import numpy as np

from forge_test_util import forge_bin, run, scratch_dir, tool, train_losses

DTYPES = ["?", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8"]


def forge_read(*args):
    return subprocess.run([tool("forge_read_npy"), *args], capture_output=True, text=True)


def write_npy(path, array, version=None):
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=version)


def write_object_npy(path, records, protocol=4, numpy1_module=False):
    """What numpy.save writes for a list of dicts, with the pickle protocol chosen."""
    array = np.empty(len(records), dtype=object)
    for i, record in enumerate(records):
        array[i] = record
    body = pickle.dumps(array, protocol=protocol)
    if numpy1_module:  # numpy 1.x names numpy.core.multiarray
        assert protocol < 4
        body = body.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
        f.write(body)


def values_of(array):
    return [int(v) for v in np.ascontiguousarray(array).reshape(-1)]


class IntegerArrays(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def test_every_dtype_order_shape_and_version(self):
        rng = np.random.default_rng(5)
        path = os.path.join(self.dir, "a.npy")
        checked = 0
        for code in DTYPES:
            for order in "<>":
                dtype = np.dtype(code).newbyteorder(order) if np.dtype(code).itemsize > 1 else np.dtype(code)
                info = np.iinfo(dtype) if code != "?" else None
                for shape in [(), (7,), (3, 5), (0,), (2, 0, 3)]:
                    if info is None:
                        array = rng.integers(0, 2, size=shape).astype(dtype)
                    else:
                        high = min(int(info.max), 2**63 - 1)
                        array = rng.integers(int(info.min), high, size=shape, endpoint=True, dtype=np.int64 if
                                             info.min < 0 else np.uint64).astype(dtype)
                        if array.size >= 2:  # the extremes of the type
                            array.reshape(-1)[0], array.reshape(-1)[1] = info.min, high
                    for version in [(1, 0), (2, 0), (3, 0)]:
                        write_npy(path, array, version)
                        result = forge_read("array", path)
                        self.assertEqual(result.returncode, 0, f"{dtype.str} {shape} {version}: {result.stderr}")
                        got = json.loads(result.stdout)
                        self.assertEqual(got["shape"], list(shape))
                        self.assertEqual(got["descr"], dtype.str)
                        self.assertEqual(got["version"], version[0])
                        self.assertEqual(got["values"], values_of(array), f"{dtype.str} {shape} {version}")
                        checked += 1
        self.assertEqual(checked, 9 * 2 * 5 * 3)

    def test_np_save_default(self):
        path = os.path.join(self.dir, "saved.npy")
        np.save(path, np.arange(24, dtype=np.int32).reshape(2, 3, 4))
        self.assertEqual(json.loads(forge_read("array", path).stdout)["values"], list(range(24)))

    def refused(self, path, *fragments):
        result = forge_read("array", path)
        self.assertEqual(result.returncode, 1, result.stdout)
        for fragment in (path, *fragments):
            self.assertIn(fragment, result.stderr)

    def test_malformed_files_are_refused(self):
        path = os.path.join(self.dir, "bad.npy")
        write_npy(path, np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)))
        self.refused(path, "'fortran_order' is True")
        write_npy(path, np.zeros(3, dtype=np.float32))
        self.refused(path, "'descr' is '<f4'")
        np.save(path, np.arange(10, dtype=np.int64))
        data = open(path, "rb").read()
        open(path, "wb").write(data[:-3])
        self.refused(path, "needs 80 bytes of data, the file holds 77: truncated")
        open(path, "wb").write(data + b"\0")
        self.refused(path, "1 trailing bytes")
        open(path, "wb").write(b"\x93NUMPX" + data[6:])
        self.refused(path, "byte offset 0: expected the .npy magic")
        open(path, "wb").write(data[:20])
        self.refused(path, "truncated header")
        write_object_npy(path, [{"input_ids": [1]}])
        self.refused(path, "'descr' is '|O'")


def govreport_record(rng, length, vocab, validation):
    """One packed block: examples "prompt SEP summary EOS" back to back, as the reference's
    group_texts packs them, with its loss mask (train: every token; validation: the summary
    but not the prompt nor each example's last token)."""
    ids, mask = [], []
    while len(ids) < length:
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randrange(2, 5))]
        summary = [(t * 3) % (vocab - 5) + 5 for t in prompt]  # a learnable function of the prompt
        example = [1, *prompt, 2, *summary, 3]
        ids += example
        mask += [1] * len(example) if not validation else [0] * (len(prompt) + 2) + [1] * len(summary) + [0]
    return {"input_ids": np.array(ids[:length], dtype=np.int64), "loss_mask": mask[:length], "seq_start_id": [0]}


class Records(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def test_records_in_every_protocol(self):
        rng = random.Random(1)
        records = [govreport_record(rng, 33, 40, validation=i % 2 == 1) for i in range(5)]
        records[1]["input_ids"] = records[1]["input_ids"].astype(np.int32)
        records[2]["input_ids"] = records[2]["input_ids"].astype(">u2")
        records[3]["loss_mask"] = np.array(records[3]["loss_mask"], dtype=np.bool_)
        records[4]["loss_mask"] = [bool(v) for v in records[4]["loss_mask"]]
        path = os.path.join(self.dir, "train.npy")
        expected = [{k: values_of(v) for k, v in r.items()} for r in records]
        cases = [(3, False), (4, False), (3, True)]
        for protocol, numpy1 in cases:
            write_object_npy(path, records, protocol, numpy1)
            result = forge_read("records", path)
            self.assertEqual(result.returncode, 0, f"protocol {protocol}: {result.stderr}")
            self.assertEqual(json.loads(result.stdout), expected, f"protocol {protocol}")
        np.save(path, records)  # exactly as convert_dataset.py
        self.assertEqual(json.loads(forge_read("records", path).stdout), expected)

    def test_a_pickle_naming_another_global_is_not_run(self):
        path = os.path.join(self.dir, "evil.npy")
        write_object_npy(path, [collections.OrderedDict(a=1)])
        result = forge_read("records", path)
        self.assertEqual(result.returncode, 1)
        self.assertIn(path, result.stderr)
        self.assertIn("the pickle names the global 'collections.OrderedDict'", result.stderr)
        shared = list(range(5000))  # one memoized list named by every record: a small file, huge records
        np.save(path, [{"input_ids": shared} for _ in range(2000)])
        result = forge_read("records", path)
        self.assertEqual(result.returncode, 1)
        self.assertIn("the records hold more values than the file has bytes", result.stderr)
        np.save(path, [{"input_ids": [1, 2]}])
        data = open(path, "rb").read()
        open(path, "wb").write(data[:-5])
        self.assertIn("truncated", forge_read("records", path).stderr)

    def test_govreport_samples_and_validation(self):
        rng = random.Random(2)
        records = [govreport_record(rng, 17, 30, validation=True) for _ in range(3)]
        records[2]["seq_start_id"] = [0, 9]
        path = os.path.join(self.dir, "validation.npy")
        np.save(path, records)
        samples = json.loads(forge_read("govreport", path, "16", "30").stdout)
        self.assertEqual(len(samples), 3)
        for sample, record in zip(samples, records):
            self.assertEqual(sample["tokens"], values_of(record["input_ids"]))
            self.assertEqual(sample["response"], record["loss_mask"])
        self.assertEqual(samples[0]["example"], [0] * 17)
        self.assertEqual(samples[2]["example"], [0] * 9 + [1] * 8)

        def refused(fragment, seq_len="16", vocab="30"):
            result = forge_read("govreport", path, seq_len, vocab)
            self.assertEqual(result.returncode, 1, result.stdout)
            self.assertIn(path, result.stderr)
            self.assertIn(fragment, result.stderr)

        refused("record 0: input_ids holds 17 tokens: expected training.seq_len + 1 = 9", seq_len="8")
        refused("expected a token id below the model's vocab_size 20", vocab="20")
        bad = [dict(r) for r in records]
        bad[1]["loss_mask"] = bad[1]["loss_mask"][:-1]
        np.save(path, bad)
        refused("record 1: loss_mask holds 16 values, input_ids 17")
        bad[1] = dict(records[1], labels=[1])
        np.save(path, bad)
        refused("record 1: unknown key 'labels'")
        bad[1] = dict(records[1], loss_mask=[2] * 17)
        np.save(path, bad)
        refused("record 1: loss_mask[0] is 2: expected 0 or 1")


class TrainOnGovReportStandIn(unittest.TestCase):
    def test_forge_train_learns_and_evaluates(self):
        root = scratch_dir()
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        data = os.path.join(root, "scrolls_gov_report_8k")
        os.makedirs(data)
        rng = random.Random(7)
        np.save(os.path.join(data, "train"), [govreport_record(rng, 33, 32, False) for _ in range(96)])
        np.save(os.path.join(data, "validation"), [govreport_record(rng, 33, 32, True) for _ in range(8)])
        run_dir = os.path.join(root, "run")
        common = ["--data.source", "govreport_npy", "--data.path", data, "--training.seq_len", "32",
                  "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "3",
                  "--lr_scheduler.decay_steps", "40", "--logging.log_interval", "1", "--eval.steps", "2"]
        run([forge_bin(), "train", *common, "--logging.run_dir", run_dir, "--training.steps", "40",
             "--eval.interval", "20"])
        losses = train_losses(run_dir)
        self.assertEqual(len(losses), 40)
        self.assertLess(sum(losses[-5:]) / 5, 0.8 * sum(losses[:5]) / 5, losses)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            evals = [r for r in map(json.loads, f) if r["type"] == "eval"]
        self.assertEqual([e["step"] for e in evals], [20, 40])
        self.assertTrue(all(np.isfinite(e["loss"]) for e in evals))

        # A sequence length that disagrees with the files stops the run naming the file.
        result = subprocess.run([forge_bin(), "train", *common, "--training.seq_len", "16", "--logging.run_dir",
                                 os.path.join(root, "short"), "--training.steps", "1"],
                                capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(os.path.join(data, "train.npy") + ": record 0: input_ids holds 33 tokens: expected "
                      "training.seq_len + 1 = 17", result.stderr + result.stdout)


if __name__ == "__main__":
    unittest.main()
