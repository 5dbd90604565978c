"""`forge mlperf llama31_8b` and `forge mlperf llama2_70b_lora` end to end on a tiny model
and tiny stand-in data in the official formats (Megatron .bin/.idx for C4, GovReport
train.npy / validation.npy), checked with the official mlperf-logging package:
 - each run writes result_K.txt and run_K; its MLLOG lines pass
   `python -m mlperf_logging.compliance_checker --ruleset 5.1.0` for the training ruleset,
   except, for llama31_8b, the one rule a CPU-sized run cannot meet: max_sequence_length
   == 8192 (the stand-in sequences are 64 tokens; the log says what was used);
 - the run stops at the first evaluation at or below the target (status success), on the
   rules' schedule (every CEIL(12288 / 32) = 384 steps; LoRA every 48 steps after
   skipping FLOOR(0.125 * 8 + 2) = 3 evaluations), with the reference's hyperparameters
   logged;
 - a run that does not reach the target logs run_stop aborted and exits 1;
 - an override the rules do not allow is refused before anything is written; seeds given
   are logged, runs are numbered after the ones already in the directory, and with 3
   result files the score is printed."""
import json
import os
import random
import shutil
import subprocess
import sys
import unittest

import numpy as np

from forge_test_util import forge_bin, run, scratch_dir, tool

try:
    import mlperf_logging  # noqa: F401
except ImportError:
    print("mlperf-logging is not installed (scripts/install-deps installs it): skipped")
    sys.exit(77)

VOCAB = 32  # debug-tiny's
SEQ = 64
# FORGE_TEST_DEVICE=cuda runs the same flows on the GPU (bf16), as scripts/mlperf-gpu-check does.
DEVICE = os.environ.get("FORGE_TEST_DEVICE", "cpu")
CPU = ["--training.device", DEVICE, "--precision.compute_dtype", "bf16" if DEVICE == "cuda" else "fp32",
       "--model.name", "debug-tiny"]


def mllog_lines(path):
    with open(path) as f:
        return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in f if ":::MLLOG " in line]


def by_key(lines, key):
    return [l for l in lines if l["key"] == key]


def compliance(path):
    result = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--ruleset", "5.1.0",
                             "--usage", "training", path], capture_output=True, text=True, cwd=os.path.dirname(path))
    failed = [l for l in (result.stdout + result.stderr).splitlines() if "CHECK for" in l or "failed" in l.lower()]
    return result.returncode, failed, result.stdout + result.stderr


def c4_documents(rng, count):
    """Low-entropy documents: a learnable stand-in for tokenized C4."""
    docs = []
    for _ in range(count):
        start = rng.randrange(VOCAB)
        step = rng.choice([1, 3, 5])
        docs.append([[(start + i * step) % VOCAB for i in range(rng.randrange(40, 200))]])
    return docs


def write_indexed(prefix, documents):
    spec = prefix + ".json"
    with open(spec, "w") as f:
        json.dump({"dtype": "uint16", "documents": documents}, f)
    run([tool("forge_write_indexed"), prefix, spec])


def govreport_record(rng, length, validation):
    """A packed block of "prompt SEP summary EOS" examples with the reference's loss mask
    (validation: the summary tokens only); each summary token is a function of the token
    before it (the first: of the prompt's last), which a tiny model learns quickly."""
    ids, mask = [], []
    while len(ids) < length:
        prompt = [rng.randrange(5, VOCAB) for _ in range(rng.randrange(2, 5))]
        summary, previous = [], prompt[-1]
        for _ in range(len(prompt)):
            previous = (previous * 3 + 1) % (VOCAB - 5) + 5
            summary.append(previous)
        example = [1, *prompt, 2, *summary, 3]
        ids += example
        mask += [1] * len(example) if not validation else [0] * (len(prompt) + 2) + [1] * len(summary) + [0]
    return {"input_ids": np.array(ids[:length], dtype=np.int64), "loss_mask": mask[:length], "seq_start_id": [0]}


class MlperfRun(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = scratch_dir()
        rng = random.Random(5)
        cls.c4_train = os.path.join(cls.dir, "c4-train.en_6_text_document")
        cls.c4_valid = os.path.join(cls.dir, "c4-validation-91205-samples.en_text_document")
        write_indexed(cls.c4_train, c4_documents(rng, 3000))
        write_indexed(cls.c4_valid, c4_documents(rng, 800))
        cls.govreport = os.path.join(cls.dir, "govreport")
        os.makedirs(cls.govreport)
        np.save(os.path.join(cls.govreport, "train.npy"),
                [govreport_record(rng, SEQ + 1, False) for _ in range(400)])
        np.save(os.path.join(cls.govreport, "validation.npy"),
                [govreport_record(rng, SEQ + 1, True) for _ in range(173)])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def llama31_8b(self, out, *extra):
        return subprocess.run([forge_bin(), "mlperf", "llama31_8b", *CPU, "--training.seq_len", str(SEQ),
                               "--training.local_batch_size", "32", "--data.path", self.c4_train,
                               "--data.validation_path", self.c4_valid, "--output", out,
                               "--logging.log_interval", "1000", *extra], capture_output=True, text=True)

    def test_llama31_8b_reaches_the_target_with_a_compliant_log(self):
        out = os.path.join(self.dir, "8b")
        first = self.llama31_8b(out, "--runs", "2", "--seeds", "7,8")
        self.assertEqual(first.returncode, 0, first.stderr)
        self.assertIn("NOT an MLPerf result", first.stderr)
        for k, seed in ((0, 7), (1, 8)):
            path = os.path.join(out, f"result_{k}.txt")
            lines = mllog_lines(path)
            self.assertEqual(by_key(lines, "seed")[0]["value"], seed)
            header = {l["key"]: l["value"] for l in lines if l["event_type"] == "POINT_IN_TIME"}
            self.assertEqual(header["global_batch_size"], 32)
            self.assertEqual(header["opt_base_learning_rate"], 8e-4)
            self.assertEqual(header["opt_end_learning_rate"], 8e-5)
            self.assertEqual(header["opt_learning_rate_warmup_steps"], 128)  # 4,096 samples / 32
            self.assertEqual(header["opt_learning_rate_decay_steps"], 1200000 - 128)
            self.assertEqual(header["eval_samples"], 1024)
            evals = by_key(lines, "eval_accuracy")
            self.assertTrue(evals)
            self.assertEqual([e["metadata"]["samples_count"] for e in evals],
                             [12288 * (i + 1) for i in range(len(evals))])
            self.assertLessEqual(evals[-1]["value"], 3.3)
            self.assertTrue(all(e["value"] > 3.3 for e in evals[:-1]))
            stop = by_key(lines, "run_stop")[0]
            self.assertEqual(stop["metadata"]["status"], "success")
            self.assertEqual(by_key(lines, "train_samples")[0]["value"], stop["metadata"]["samples_count"])
            stats = by_key(lines, "tracked_stats")
            self.assertEqual(len(stats), len(evals))
            self.assertGreater(stats[0]["value"]["throughput"], 0)
            order = [l["key"] for l in lines if l["key"] in ("init_start", "init_stop", "run_start", "run_stop")]
            self.assertEqual(order, ["init_start", "init_stop", "run_start", "run_stop"])
            code, failed, text = compliance(path)
            self.assertEqual(code, 1, text)  # only the sequence length, which a CPU-sized run cannot have
            self.assertEqual(len([l for l in failed if "CHECK for" in l]), 1, text)
            self.assertIn("CHECK for 'max_sequence_length' failed", text)
            self.assertTrue(os.path.isfile(os.path.join(out, f"run_{k}", "metrics.jsonl")))
        with open(os.path.join(out, "report.html")) as f:
            page = f.read()
        self.assertIn("result_1.txt", page)
        self.assertIn("No score", page)
        # A third run is numbered after the two; with three result files the set is scored.
        third = self.llama31_8b(out)
        self.assertEqual(third.returncode, 0, third.stderr)
        self.assertTrue(os.path.isfile(os.path.join(out, "result_2.txt")))
        self.assertIn("mean time-to-train", third.stdout)
        self.assertIn("RCP check", third.stdout)
        with open(os.path.join(out, "report.html")) as f:
            self.assertIn("result_2.txt", f.read())

    def test_refused_overrides_write_nothing(self):
        out = os.path.join(self.dir, "refused")
        for extra, fragment in ((["--optimizer.weight_decay", "0.2"], "llama31_8b fixes it"),
                                (["--lora.rank", "8"], "llama31_8b fixes it"),
                                (["--training.global_batch_size", "48"], "no llama31_8b RCP was measured at that batch"),
                                (["--training.local_batch_size", "3"], "must divide 1024"),
                                (["--seeds", "1,x"], "'x' is not a seed")):
            result = self.llama31_8b(out, *extra)
            self.assertNotEqual(result.returncode, 0)
            self.assertIn(fragment, result.stderr)
            self.assertFalse(os.path.exists(out))
        result = subprocess.run([forge_bin(), "mlperf", "llama31_8b", *CPU, "--training.seq_len", str(SEQ),
                                 "--data.path", self.c4_train, "--output", out], capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--data.validation_path", result.stderr)
        # A bad data file fails the run before run_start: an error naming it, and no result file left.
        result = self.llama31_8b(out, "--data.validation_path", os.path.join(self.dir, "missing"))
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("missing", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "result_0.txt")))

    def lora_base(self):
        """A tiny base model trained on the stand-in, as a Hugging Face folder: LoRA on a
        random base would not reach 0.925."""
        run_dir = os.path.join(self.dir, "base")
        run([forge_bin(), "train", *CPU, "--data.source", "govreport_npy", "--data.path", self.govreport,
             "--training.seq_len", str(SEQ), "--training.local_batch_size", "8", "--training.steps", "150",
             "--optimizer.lr", "1e-2", "--eval.interval", "0", "--logging.run_dir", run_dir,
             "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "fp32"])
        return os.path.join(run_dir, "hf")

    def test_llama2_70b_lora(self):
        base = self.lora_base()
        out = os.path.join(self.dir, "lora")
        args = [forge_bin(), "mlperf", "llama2_70b_lora", *CPU, "--training.seq_len", str(SEQ),
                "--data.path", self.govreport, "--checkpoint.initial_load_path", base, "--output", out,
                "--logging.log_interval", "1000", "--optimizer.lr", "4e-3"]
        result = subprocess.run(args, capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("hyperparameter chosen on the command line, as the rules allow: optimizer.lr 4e-3",
                      result.stdout + result.stderr)
        path = os.path.join(out, "result_0.txt")
        lines = mllog_lines(path)
        header = {l["key"]: l["value"] for l in lines if l["event_type"] == "POINT_IN_TIME"}
        self.assertEqual(header["lora_rank"], 16)
        self.assertEqual(header["lora_alpha"], 32.0)
        self.assertEqual(header["opt_gradient_clip_norm"], 0.3)
        self.assertEqual(header["opt_adamw_weight_decay"], 0.0001)
        self.assertEqual(header["opt_learning_rate_training_steps"], 1024)
        self.assertEqual(header["train_samples"], 400)
        self.assertEqual(header["eval_samples"], 173)
        evals = by_key(lines, "eval_accuracy")
        # Every 384 samples (48 steps of 8), the first 3 evaluations skipped.
        self.assertEqual(evals[0]["metadata"]["samples_count"], 4 * 384)
        self.assertLessEqual(evals[-1]["value"], 0.925)
        self.assertEqual(by_key(lines, "run_stop")[0]["metadata"]["status"], "success")
        code, failed, text = compliance(path)
        self.assertEqual(code, 0, text)

        # Too few training steps for the first evaluation: aborted, exit status 1.
        short = subprocess.run(args + ["--training.steps", "5"], capture_output=True, text=True)
        self.assertEqual(short.returncode, 1, short.stderr)
        lines = mllog_lines(os.path.join(out, "result_1.txt"))
        self.assertEqual(by_key(lines, "run_stop")[0]["metadata"]["status"], "aborted")
        self.assertFalse(by_key(lines, "eval_accuracy"))


if __name__ == "__main__":
    unittest.main()
