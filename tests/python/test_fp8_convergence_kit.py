"""scripts/fp8-convergence end to end on the CPU, at a tiny size: `forge prep` of the committed
corpus, the BF16-baseline experiment (configs/experiments/fp8-convergence) trained with
precision.fp8 none and tensorwise from the same seed, `forge report` over both, the summary,
the copy to $OUT; then --report-only, and a recipe forge refuses. Also checks the experiment's
arithmetic against the prepared data: 2,000 steps stay within two epochs of the training split
and one evaluation reads the whole validation split once.
"""
import os
import shutil
import struct
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402

EXPERIMENT = os.path.join("configs", "experiments", "fp8-convergence", "llama-150m-web-bible.yaml")
TINY = ["--model.num_layers", "1", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.head_dim", "16", "--model.ffn_hidden_size", "128", "--training.seq_len", "64", "--eval.steps", "2"]


def kit(args, env=None):
    script = os.path.join(forge_test_util.source_dir(), "scripts", "fp8-convergence")
    return subprocess.run([script, "--forge", forge_test_util.forge_bin(), "--device", "cpu"] + args,
                          capture_output=True, text=True, env=env)


def sequence_lengths(idx_path):
    """Token count of each sequence of a Megatron MMIDIDX .idx file."""
    with open(idx_path, "rb") as f:
        data = f.read()
    assert data[:9] == b"MMIDIDX\x00\x00", idx_path
    count = struct.unpack_from("<Q", data, 18)[0]
    return list(struct.unpack_from(f"<{count}i", data, 34))


def split_tokens(lengths, weights):
    """Tokens per split, with megatron-core's bookends (round-half-to-even of the cumulative weights)."""
    total = sum(weights)
    bounds, acc = [0], 0.0
    for w in weights:
        acc += w / total
        bounds.append(round(acc * len(lengths)))
    return [sum(lengths[a:b]) for a, b in zip(bounds, bounds[1:])]


class Fp8ConvergenceKit(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        cls.runs = os.path.join(cls.directory, "runs")
        cls.out = os.path.join(cls.directory, "out")
        os.makedirs(cls.out)
        cls.result = kit(["--steps", "4", "--runs", cls.runs, "none", "tensorwise", "--"] + TINY,
                         env=dict(os.environ, OUT=cls.out))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def test_pipeline_runs_both_recipes(self):
        r = self.result
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        with open(os.path.join(self.runs, "summary.txt")) as f:
            summary = f.read()
        self.assertTrue(r.stdout.rstrip().endswith(summary.rstrip()), "the summary is not printed last")
        rows = {line.split()[0]: line.split() for line in summary.splitlines() if line.split()[:1] in (["none"],
                                                                                                      ["tensorwise"])}
        self.assertEqual(rows["none"][1], "4/4")
        self.assertEqual(rows["tensorwise"][1], "4/4")
        self.assertIn("tensorwise: final validation loss", summary)
        self.assertIn("PASS", summary)
        with open(os.path.join(self.runs, "report.html")) as f:
            report = f.read()
        self.assertIn(os.path.join(self.runs, "none"), report)
        self.assertIn(os.path.join(self.runs, "tensorwise"), report)
        self.assertIn("FP8 (tensorwise)", report)
        for name in ("report.html", "summary.txt", "none/metrics.jsonl", "tensorwise/metrics.jsonl", "none.log"):
            self.assertTrue(os.path.exists(os.path.join(self.out, "fp8-convergence", name)), f"$OUT lacks {name}")
        print(summary)

    def test_same_initialization_and_data(self):
        losses = {r: forge_test_util.train_losses(os.path.join(self.runs, r)) for r in ("none", "tensorwise")}
        self.assertEqual(len(losses["none"]), 4)
        # Same seed: the same weights see the same first batch; only the FP8 GEMMs differ.
        self.assertAlmostEqual(losses["tensorwise"][0] / losses["none"][0], 1.0, delta=0.01)
        configs = {}
        for r in ("none", "tensorwise"):
            with open(os.path.join(self.runs, r, "config.yaml")) as f:
                configs[r] = [line for line in f if "run_dir" not in line and "fp8:" not in line]
        self.assertEqual(configs["none"], configs["tensorwise"])

    def test_report_only_and_a_refused_recipe(self):
        again = kit(["--report-only", "--runs", self.runs, "none", "tensorwise"])
        self.assertEqual(again.returncode, 0, again.stdout + again.stderr)
        self.assertIn("4/4", again.stdout)
        refused = kit(["--steps", "2", "--runs", os.path.join(self.directory, "refused"), "nonexistent_recipe", "--"]
                      + TINY)
        self.assertEqual(refused.returncode, 1, refused.stdout + refused.stderr)
        self.assertIn("precision.fp8", refused.stdout)
        self.assertIn("no run", refused.stdout)
        bad = kit(["--steps", "0", "none"])
        self.assertEqual(bad.returncode, 1)
        self.assertIn("--steps must be a positive integer", bad.stderr)

    def test_experiment_fits_the_corpus(self):
        import yaml

        with open(os.path.join(forge_test_util.source_dir(), EXPERIMENT)) as f:
            experiment = yaml.safe_load(f)
        t, e = experiment["training"], experiment["eval"]
        lengths = sequence_lengths(os.path.join(self.runs, "data", "web-bible.idx"))
        train, validation, _ = split_tokens(lengths, [int(w) for w in experiment["data"]["split"].split(",")])
        train_samples = (train - 1) // t["seq_len"]
        validation_samples = (validation - 1) // t["seq_len"]
        epochs = t["steps"] * t["local_batch_size"] * t["gradient_accumulation_steps"] / train_samples
        self.assertEqual(t["steps"], 2000)
        self.assertLessEqual(epochs, 2.0)
        self.assertEqual(e["steps"] * t["local_batch_size"], validation_samples)
        print(f"training split {train} tokens ({train_samples} samples), validation {validation} tokens "
              f"({validation_samples} samples); 2,000 steps cover {epochs:.2f} epochs")


if __name__ == "__main__":
    unittest.main()
