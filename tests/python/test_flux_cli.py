"""FLUX runs through the CLI on the CPU reference: forge train on the flux-debug experiment
(the loss is finite and logged per step), forge bench on it (images/s in bench.json, a
perf.csv row), forge info flux1-dev (the published parameter count, FLOPs and memory), and
the refusals: flux.* keys without flux.model, an image size the patches do not divide, the
language models' features a FLUX run lacks, an unknown key to forge info."""
import csv
import json
import os
import re
import subprocess
import unittest

from forge_test_util import forge_bin, scratch_dir, source_dir


def forge(*args):
    return subprocess.run([forge_bin(), *args], capture_output=True, text=True, timeout=600)


def experiment():
    return os.path.join(source_dir(), "configs", "experiments", "cpu", "flux-debug.yaml")


class FluxCli(unittest.TestCase):
    def test_train_logs_every_step(self):
        run_dir = os.path.join(scratch_dir(), "run")
        result = forge("train", experiment(), "--training.steps", "4", "--logging.run_dir", run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        losses = [float(m) for m in re.findall(r"step +\d+ \| loss ([0-9.]+)", result.stderr + result.stdout)]
        self.assertEqual(len(losses), 4, result.stderr)
        self.assertTrue(all(0 < loss < 10 for loss in losses), losses)

    def test_bench_reports_images_per_second(self):
        tmp = scratch_dir()
        out, perf = os.path.join(tmp, "bench"), os.path.join(tmp, "perf.csv")
        result = forge("bench", experiment(), "--warmup", "1", "--steps", "2", "--output-dir", out, "--perf-csv", perf)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("images/s/GPU", result.stderr + result.stdout)
        with open(os.path.join(out, "bench.json")) as f:
            (r,) = json.load(f)
        self.assertEqual(r["status"], "ok", r["error"])
        self.assertEqual(r["model"], "flux-debug")
        self.assertGreater(r["images_per_s_per_gpu"], 0)
        self.assertGreater(r["tflops_per_gpu"], 0)
        self.assertEqual(r["seq_len"], 16 + 8)  # a 4x4 latent grid of 64-pixel images, 8 text tokens
        with open(perf) as f:
            self.assertEqual(len(list(csv.DictReader(f))), 1)

    def test_info_flux1_dev(self):
        result = forge("info", "flux1-dev")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("11901408320", result.stdout)
        self.assertIn("4096 image tokens", result.stdout)
        self.assertIn("FLOPs per image", result.stdout)
        self.assertIn("activation_checkpoint.mode full", result.stdout)
        result = forge("info", "flux1-schnell", "--flux.resolution", "512", "--activation_checkpoint.mode", "none")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("1024 image tokens", result.stdout)
        result = forge("info", "flux1-dev", "--training.seq_len", "4")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--training.seq_len", result.stderr)

    def test_bad_flux_settings_are_refused(self):
        cases = [
            (["--flux.model", "", "--flux.resolution", "512"], "flux.model is empty"),
            (["--flux.resolution", "72"], "multiple of 16"),
            (["--flux.model", "flux3"], "unknown FLUX model"),
            (["--lora.rank", "8"], "lora.rank"),
            (["--activation_checkpoint.mode", "selective"], "none or full"),
            (["--eval.interval", "5"], "eval.interval 0"),
        ]
        for overrides, fragment in cases:
            with self.subTest(overrides):
                result = forge("train", experiment(), "--training.steps", "1", *overrides)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(fragment, result.stderr)


if __name__ == "__main__":
    unittest.main()
