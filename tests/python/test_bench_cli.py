"""forge bench end to end on the CPU reference: a sweep runs every combination, reports
each (markdown table, bench.json, perf.csv rows with ROCm MAD's columns), a combination
that fails does not end the sweep but makes the exit code non-zero, and bad bench flags
are clear errors. (Throughput itself is measured on the GPU, never in a test.)"""
import csv
import json
import os
import subprocess
import unittest

from forge_test_util import forge_bin, scratch_dir


def forge(*args, cwd=None):
    return subprocess.run([forge_bin(), *args], capture_output=True, text=True, cwd=cwd)


class Bench(unittest.TestCase):
    def test_sweep_reports_every_combination(self):
        out = os.path.join(scratch_dir(), "bench")
        perf = os.path.join(scratch_dir(), "perf.csv")
        result = forge("bench", "--warmup", "1", "--steps", "2", "--output-dir", out, "--perf-csv", perf,
                       "--training.local_batch_size", "1,2", "--activation_checkpoint.mode", "none,full")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("| Model |", result.stdout)
        with open(os.path.join(out, "bench.json")) as f:
            runs = json.load(f)
        self.assertEqual([(r["micro_batch"], r["activation_checkpoint"]) for r in runs],
                         [(1, "none"), (1, "full"), (2, "none"), (2, "full")])
        for r in runs:
            self.assertEqual(r["status"], "ok")
            self.assertEqual(r["warmup_steps"], 1)
            self.assertEqual(r["measured_steps"], 2)
            self.assertGreater(r["tokens_per_s_per_gpu"], 0)
            self.assertLessEqual(r["step_time_min_s"], r["step_time_median_s"])
            self.assertLessEqual(r["step_time_median_s"], r["step_time_max_s"])
            self.assertEqual(r["config"]["data"]["source"], "mock")
        with open(perf) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 4)
        self.assertIn("--training.local_batch_size 2", rows[2]["args"])

    def test_fp8_is_a_sweep_axis_and_named_in_every_report(self):
        tmp = scratch_dir()
        out = os.path.join(tmp, "bench-fp8")
        perf = os.path.join(tmp, "perf-fp8.csv")
        result = forge("bench", "--warmup", "1", "--steps", "2", "--output-dir", out, "--perf-csv", perf,
                       "--precision.fp8", "none,tensorwise")
        self.assertEqual(result.returncode, 0, result.stderr)
        rows = [line for line in result.stdout.splitlines() if line.startswith("| debug-tiny")]
        self.assertEqual(len(rows), 2, result.stdout)
        self.assertIn("| FP32 |", rows[0])
        self.assertNotIn("FP8", rows[0])
        # The CPU has no known peak: both MFUs n/a.
        self.assertIn("| FP8 (tensorwise) |", rows[1])
        self.assertIn("| n/a (FP8 peak n/a) |", rows[1])
        with open(os.path.join(out, "bench.json")) as f:
            runs = json.load(f)
        self.assertEqual([(r["status"], r["fp8"]) for r in runs], [("ok", "none"), ("ok", "tensorwise")])
        self.assertEqual(runs[1]["config"]["precision"]["fp8"], "tensorwise")
        self.assertIsNone(runs[1]["mfu_fp8"])
        self.assertGreater(runs[1]["tflops_per_gpu"], 0)
        with open(perf) as f:
            self.assertEqual([r["training_precision"] for r in csv.DictReader(f)], ["fp32", "fp8 (tensorwise)"])
        report = forge("report", out, "--output", os.path.join(tmp, "bench-fp8.html"))
        self.assertEqual(report.returncode, 0, report.stderr)
        with open(os.path.join(tmp, "bench-fp8.html")) as f:
            html = f.read()
        self.assertIn("FP8 (tensorwise)", html)
        self.assertIn("FP8 peak n/a", html)
        # Each run's own directory: the runs table names the precision from its config.yaml.
        run_dirs = sorted(os.path.join(out, d) for d in os.listdir(out) if os.path.isdir(os.path.join(out, d)))
        self.assertEqual(len(run_dirs), 2)
        report = forge("report", *run_dirs, "--output", os.path.join(tmp, "bench-fp8-runs.html"))
        self.assertEqual(report.returncode, 0, report.stderr)
        with open(os.path.join(tmp, "bench-fp8-runs.html")) as f:
            self.assertEqual(f.read().count("FP8 (tensorwise)"), 1)

    def test_a_run_that_fails_does_not_end_the_sweep(self):
        # On a build without the CUDA backend (CI's) the cuda run fails when it starts.
        out = os.path.join(scratch_dir(), "bench-fail")
        result = forge("bench", "--warmup", "0", "--steps", "1", "--output-dir", out, "--perf-csv", "",
                       "--training.device", "cuda,cpu")
        with open(os.path.join(out, "bench.json")) as f:
            runs = json.load(f)
        self.assertEqual(runs[1]["status"], "ok")
        if runs[0]["status"] == "ok":
            self.skipTest("this forge has a CUDA backend and a GPU: the cuda run did not fail")
        self.assertEqual(runs[0]["status"], "failed")
        self.assertIn("CUDA", runs[0]["error"])
        self.assertNotEqual(result.returncode, 0)

    def test_a_bad_sweep_value_stops_before_any_run(self):
        out = os.path.join(scratch_dir(), "bench-bad-value")
        result = forge("bench", "--warmup", "0", "--steps", "1", "--output-dir", out, "--perf-csv", "",
                       "--training.seq_len", "64,100000")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--training.seq_len 100000", result.stderr)
        self.assertIn("model.max_seq_len", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "bench.json")))

    def test_bad_flags_are_named(self):
        for args, expected in ((["--steps", "0"], "--steps"), (["--warmup", "x"], "--warmup"),
                               (["--find-max-batch", "--training.local_batch_size", "2"], "--find-max-batch"),
                               (["--steps"], "--steps"), (["--find-max-batch"], "training.device cuda")):
            result = forge("bench", "--output-dir", os.path.join(scratch_dir(), "bad"), *args)
            self.assertNotEqual(result.returncode, 0, args)
            self.assertIn(expected, result.stderr, args)


if __name__ == "__main__":
    unittest.main()
