"""`forge mlperf flux1` (NOTE [MLPerf Flux.1] in src/train/mlperf_benchmark.h) end to end on the
CPU: flux-debug and flux-small cut to one double block, on tiny latent caches in the layout `forge prep
--images` writes (with the empty caption's encodings that caption dropout needs), checked with
the official mlperf-logging package:
 - the run evaluates every 262,144 images (64 steps at the RCP batch 4,096), logs
   closed_flux1.yaml's hyperparameters (the RCP's LR 4e-4 and 100 warm-up steps at 4,096,
   AdamW 0.9/0.95/1e-8/0.1, clipping 1.0), train_samples (the cache's images) and
   eval_samples (the validation cache's), and eval_accuracy with samples_count in images;
 - a run that reaches a validation loss of 0.586 stops there with run_stop success, and its
   log passes `python -m mlperf_logging.compliance_checker --ruleset 5.1.0`;
 - a run that stops short of the target passes it except for the one rule it cannot meet (an
   eval_accuracy <= 0.586), ends with run_stop aborted and exits 1;
 - caches that are not the benchmark's (16x16 images, 1 T5 token, 64 validation images) and
   the smoke test's keys are named as making it NOT an MLPerf result;
 - runs without the caches, and overrides the rules fix, are refused before anything is
   written."""
import json
import os
import shutil
import subprocess
import sys
import unittest

import numpy as np

from forge_test_util import forge_bin, scratch_dir
from test_flux_cache_training import write_cache

try:
    import mlperf_logging  # noqa: F401
except ImportError:
    print("mlperf-logging is not installed (scripts/install-deps installs it): skipped")
    sys.exit(77)

DEVICE = os.environ.get("FORGE_TEST_DEVICE", "cpu")
SMOKE = ["--training.device", DEVICE, "--precision.compute_dtype", "bf16" if DEVICE == "cuda" else "fp32",
         "--flux.num_double_blocks", "1", "--flux.num_single_blocks", "0",
         "--training.global_batch_size", "4096", "--training.local_batch_size", "1024"]


def mllog_lines(path):
    with open(path) as f:
        return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in f if ":::MLLOG " in line]


def compliance(path):
    result = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--ruleset", "5.1.0",
                             "--usage", "training", path], capture_output=True, text=True, cwd=os.path.dirname(path))
    return result.returncode, result.stdout + result.stderr


class MlperfFlux(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = scratch_dir()
        rng = np.random.default_rng(3)
        empty = (rng.standard_normal((1, 1, 32), dtype=np.float32), rng.standard_normal((1, 16), dtype=np.float32))

        def small(tensors):
            tensors["latents"] *= 0.05

        cls.train = write_cache(os.path.join(cls.dir, "cc12m"), [(16, 16, 2048)], text_tokens=1, per_shard=1024,
                                seed=1, empty_prompt=empty, edit=small)
        cls.eval = write_cache(os.path.join(cls.dir, "coco"), [(16, 16, 64)], text_tokens=1, per_shard=64, seed=2,
                               empty_prompt=empty, edit=small)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def mlperf(self, out, *extra, model="flux-debug"):
        return subprocess.run([forge_bin(), "mlperf", "flux1", *SMOKE, "--flux.model", model, "--output", out, *extra],
                              capture_output=True, text=True, timeout=900)

    def test_reaches_the_target_with_a_compliant_log(self):
        # flux-small (hidden 128, wider than a token's 64 latent features) learns these latents'
        # velocity to below 0.586 by its second evaluation.
        out = os.path.join(self.dir, "success")
        result = self.mlperf(out, "--flux.data_path", self.train, "--flux.eval_data_path", self.eval,
                             "--training.steps", "640", "--seeds", "4", "--logging.log_interval", "1000",
                             model="flux-small")
        self.assertEqual(result.returncode, 0, result.stderr)
        path = os.path.join(out, "result_0.txt")
        lines = mllog_lines(path)
        evals = [l for l in lines if l["key"] == "eval_accuracy"]
        self.assertLessEqual(evals[-1]["value"], 0.586)
        self.assertTrue(all(e["value"] > 0.586 for e in evals[:-1]))
        self.assertEqual([e["metadata"]["samples_count"] for e in evals], [262144 * (i + 1) for i in range(len(evals))])
        stop = [l for l in lines if l["key"] == "run_stop"][0]
        self.assertEqual(stop["metadata"]["status"], "success")
        self.assertEqual(stop["metadata"]["samples_count"], evals[-1]["metadata"]["samples_count"])
        order = [l["key"] for l in lines if l["key"] in ("init_start", "init_stop", "run_start", "run_stop")]
        self.assertEqual(order, ["init_start", "init_stop", "run_start", "run_stop"])
        code, text = compliance(path)
        self.assertEqual(code, 0, text)

    def test_a_run_short_of_the_target_logs_a_compliant_aborted_run(self):
        out = os.path.join(self.dir, "flux1")
        result = self.mlperf(out, "--flux.data_path", self.train, "--flux.eval_data_path", self.eval,
                             "--training.steps", "64", "--seeds", "9", "--logging.log_interval", "1000")
        self.assertEqual(result.returncode, 1, result.stderr)  # ended at training.steps without the target
        log = result.stdout + result.stderr
        for fragment in ("flux.model flux-debug is not the benchmark's", "1 T5 tokens per caption, not 256",
                         "images of 16x16, not 256x256", "over 64 images, not COCO-2014's 29696",
                         "NOT an MLPerf result"):
            self.assertIn(fragment, log)
        path = os.path.join(out, "result_0.txt")
        lines = mllog_lines(path)
        header = {l["key"]: l["value"] for l in lines if l["event_type"] == "POINT_IN_TIME"}
        self.assertEqual(header["submission_benchmark"], "flux1")
        self.assertEqual(header["seed"], 9)
        self.assertEqual(header["global_batch_size"], 4096)
        self.assertEqual(header["gradient_accumulation_steps"], 4)
        self.assertEqual(header["evaluation_frequency"], 262144)
        self.assertEqual(header["opt_base_learning_rate"], 4e-4)
        self.assertEqual(header["opt_learning_rate_warmup_steps"], 100)
        self.assertEqual((header["opt_adamw_beta_1"], header["opt_adamw_beta_2"], header["opt_adamw_epsilon"],
                          header["opt_adamw_weight_decay"], header["opt_gradient_clip_norm"]),
                         (0.9, 0.95, 1e-8, 0.1, 1.0))
        self.assertEqual(header["train_samples"], 2048)
        self.assertEqual(header["eval_samples"], 64)
        evals = [l for l in lines if l["key"] == "eval_accuracy"]
        self.assertEqual([e["metadata"]["samples_count"] for e in evals], [262144])
        self.assertGreater(evals[0]["value"], 0.586)
        stop = [l for l in lines if l["key"] == "run_stop"][0]
        self.assertEqual(stop["metadata"], {**stop["metadata"], "status": "aborted", "samples_count": 262144})
        stats = [l for l in lines if l["key"] == "tracked_stats"]
        self.assertEqual(len(stats), 1)
        self.assertGreater(stats[0]["value"]["throughput"], 0)
        self.assertGreater(stats[0]["value"]["tflops_per_gpu"], 0)
        code, text = compliance(path)
        failed = [l for l in text.splitlines() if "Failed checks" in l or "CHECK for" in l]
        self.assertNotEqual(code, 0, text)
        self.assertEqual(len(failed), 1, text)  # only: no eval_accuracy at or below 0.586
        self.assertIn("eval_accuracy", failed[0])

    def test_refusals_write_nothing(self):
        out = os.path.join(self.dir, "refused")
        for extra, fragment in [((), "--flux.data_path DIR"),
                                (("--flux.data_path", self.train), "--flux.eval_data_path DIR"),
                                (("--flux.timestep_sampling", "logit_normal"), "flux1 fixes it"),
                                (("--flux.caption_dropout_prob", "0"), "flux1 fixes it"),
                                (("--training.global_batch_size", "1000"), "no flux1 RCP was measured")]:
            with self.subTest(extra=extra):
                result = self.mlperf(out, *extra)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(fragment, result.stderr)
                self.assertFalse(os.path.exists(os.path.join(out, "result_0.txt")))


if __name__ == "__main__":
    unittest.main()
