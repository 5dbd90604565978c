"""forge's MLLOG output and `forge mlperf score` against the official mlperf-logging package
(PyPI mlperf-logging 4.1.68, installed by scripts/install-deps):
 - synthetic result files written by forge's writer (tests/tools/forge_mllog_synthetic) for
   llama31_8b and llama2_70b_lora pass `python -m mlperf_logging.compliance_checker
   --ruleset 5.1.0 --usage training`, and the checker rejects them when a required key is
   missing or a checked hyperparameter is wrong (the test is real);
 - every line parses with the package's parser and is byte for byte what
   mlperf_logging.mllog's encoder writes for the same event;
 - the RCP tables embedded in forge equal the package's JSON files, with the same
   statistics and the same pruning;
 - on synthetic sets of runs, forge's normalization factor, RCP verdict and score equal
   rcp_checker.check_directory's and the result summarizer's;
 - `forge mlperf score DIR --html FILE` writes a well-formed page with every run (its seed
   and tracked_stats throughput), the printed summary and the eval-curve chart, also when
   the RCP check fails or the set is too small to score, and fails naming FILE when it
   cannot be written."""
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import unittest
import xml.etree.ElementTree as ET

from forge_test_util import forge_bin, run, scratch_dir, tool

try:
    import mlperf_logging
    from mlperf_logging.compliance_checker import mlp_parser
    from mlperf_logging.mllog import mllog
    from mlperf_logging.rcp_checker import rcp_checker
    from mlperf_logging.result_summarizer import result_summarizer
except ImportError:
    print("mlperf-logging is not installed (scripts/install-deps installs it): skipped")
    sys.exit(77)

RULESET = "5.1.0"
BENCHMARKS = ("llama31_8b", "llama2_70b_lora", "flux1")
PACKAGE = os.path.dirname(mlperf_logging.__file__)


def synthetic(benchmark, path, *options):
    run([tool("forge_mllog_synthetic"), "log", benchmark, path, *map(str, options)])
    return path


def compliance(path):
    result = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.compliance_checker", "--ruleset", RULESET, "--usage", "training",
         "--log_output", path + ".checker.log", path],
        capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr


def forge_score(directory, *args):
    return subprocess.run([forge_bin(), "mlperf", "score", directory, *args], capture_output=True, text=True)


class Compliance(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_synthetic_logs_pass_the_compliance_checker(self):
        for benchmark in BENCHMARKS:
            # tracked_stats as forge's run mode logs it (all three members) too
            for options in ([], ["--tracked-stats", "all"]):
                with self.subTest(benchmark=benchmark, options=options):
                    path = synthetic(benchmark, os.path.join(self.dir, f"result_{benchmark}.txt"), *options)
                    status, output = compliance(path)
                    self.assertEqual(status, 0, output)
                    self.assertIn(f"training_{RULESET}/closed_{benchmark}.yaml", output)
                    self.assertIn("SUCCESS", output)

    def test_checker_rejects_missing_keys_and_wrong_values(self):
        cases = [
            ("llama31_8b", ["--omit", "opt_adamw_beta_2"]),
            ("llama31_8b", ["--set", "opt_adamw_beta_2=0.99"]),
            ("llama31_8b", ["--set", "max_sequence_length=4096"]),
            ("llama31_8b", ["--set", "opt_learning_rate_decay_steps=1200000"]),
            ("llama31_8b", ["--set", "eval_samples=512"]),
            ("llama31_8b", ["--omit", "init_stop"]),
            ("llama31_8b", ["--omit", "submission_platform"]),
            ("llama31_8b", ["--status", "none"]),
            ("llama2_70b_lora", ["--set", "lora_rank=8"]),
            ("llama2_70b_lora", ["--omit", "lora_alpha"]),
            ("llama2_70b_lora", ["--omit", "gradient_accumulation_steps"]),
            ("llama2_70b_lora", ["--omit", "cache_clear"]),
            ("llama2_70b_lora", ["--status", "aborted"]),  # its evaluations never reach 0.925
            ("flux1", ["--set", "evaluation_frequency=614400"]),
            ("flux1", ["--set", "opt_adamw_beta_2=0.999"]),
            ("flux1", ["--omit", "opt_learning_rate_warmup_steps"]),
        ]
        for i, (benchmark, options) in enumerate(cases):
            with self.subTest(benchmark=benchmark, options=options):
                path = synthetic(benchmark, os.path.join(self.dir, f"bad_{i}.txt"), *options)
                status, output = compliance(path)
                self.assertNotEqual(status, 0, output)
                self.assertIn("FAILED", output)

    def test_lines_are_what_the_package_writes(self):
        for benchmark in BENCHMARKS:
            path = synthetic(benchmark, os.path.join(self.dir, f"{benchmark}.txt"))
            with open(path) as f:
                lines = f.read().splitlines()
            loglines, failed = mlp_parser.parse_file(path, ruleset=RULESET)
            self.assertEqual(failed, [])
            self.assertEqual(len(loglines), len(lines))
            for line in lines:
                record = json.loads(line[len(":::MLLOG "):], object_pairs_hook=collections.OrderedDict)
                self.assertEqual(list(record), ["namespace", "time_ms", "event_type", "key", "value", "metadata"])
                self.assertEqual(list(record["metadata"])[:2], ["file", "lineno"])
                self.assertTrue(record["metadata"]["file"].startswith("tests/tools/"), record["metadata"])
                expected = mllog._encode_log(record["namespace"], record["time_ms"], record["event_type"],
                                             record["key"], record["value"], record["metadata"])
                self.assertEqual(line, expected)


def package_rcps(benchmark):
    with open(os.path.join(PACKAGE, "rcp_checker", f"training_{RULESET}", f"rcps_{benchmark}.json")) as f:
        return json.load(f)


class RcpTables(unittest.TestCase):
    def test_embedded_tables_equal_the_package(self):
        embedded = json.loads(run([tool("forge_mllog_synthetic"), "rcps"]).stdout)
        self.assertEqual(sorted(embedded), sorted(BENCHMARKS))
        for benchmark in BENCHMARKS:
            with self.subTest(benchmark=benchmark):
                ours = embedded[benchmark]
                self.assertEqual(ours["submission_runs"], rcp_checker.submission_runs["training"][benchmark])
                raw = package_rcps(benchmark)
                self.assertEqual(sorted(ours["records"]), sorted(raw))
                for name, record in raw.items():
                    samples = record.get("samples to converge", record.get("Epochs to converge"))
                    self.assertEqual(ours["records"][name]["BS"], record["BS"])
                    self.assertEqual(ours["records"][name]["samples"], samples)
                checker = rcp_checker.RCP_Checker("training", RULESET, benchmark, False)
                for name, record in checker.rcp_data.items():
                    mine = ours["records"][name]
                    self.assertAlmostEqual(mine["mean"], record["RCP Mean"], delta=1e-9 * record["RCP Mean"])
                    self.assertAlmostEqual(mine["stdev"], record["RCP Stdev"], delta=1e-9 * record["RCP Mean"])
                    self.assertAlmostEqual(mine["min_mean"], record["Min Epochs"], delta=1e-3)
                self.assertEqual(ours["pruned"], list(checker.pruned_rcp_data))


# (benchmark, batch, [(samples, minutes, status)]): sets around, above and below the RCPs.
LORA = [3072, 2688, 3072, 3456, 3072, 3072, 3456, 3072, 2688, 3072]
LORA_TIMES = [23.1, 22.4, 24.9, 23.7, 22.9, 26.3, 23.3, 22.8, 21.7, 24.0]
SETS = {
    "lora_found": ("llama2_70b_lora", 8, [(s, t, "success") for s, t in zip(LORA, LORA_TIMES)]),
    "lora_slower_than_rcp": ("llama2_70b_lora", 8, [(s + 768, t, "success") for s, t in zip(LORA, LORA_TIMES)]),
    "lora_too_fast": ("llama2_70b_lora", 8, [(1536, t, "success") for t in LORA_TIMES]),
    "lora_one_aborted": ("llama2_70b_lora", 8,
                         [(s, t, "success") for s, t in zip(LORA[:9], LORA_TIMES[:9])] + [(3840, 40.0, "aborted")]),
    "lora_interpolated": ("llama2_70b_lora", 64, [(6912 + 384 * (i % 3), 15 + i, "success") for i in range(10)]),
    "lora_missing_rcp": ("llama2_70b_lora", 256, [(13056, 10 + i, "success") for i in range(10)]),
    "lora_below_smallest": ("llama2_70b_lora", 4, [(3456, 30 + i, "success") for i in range(10)]),
    "8b_found": ("llama31_8b", 32, [(172032 + 12288 * (i % 2), 110 + 3 * i, "success") for i in range(10)]),
    "8b_interpolated_one_unfinished": (
        "llama31_8b", 48, [(196608, 100 + i, "success") for i in range(9)] + [(98304, 50, "none")]),
}


def parse_summary(stdout):
    factor = float(re.search(r"^normalization factor: ([0-9.]+)$", stdout, re.M).group(1))
    score = float(re.search(r"^score: ([0-9.]+) minutes$", stdout, re.M).group(1))
    verdict = re.search(r"^RCP check: (PASSED|FAILED) \((.*)\)$", stdout, re.M)
    return factor, score, verdict.group(1) == "PASSED", verdict.group(2)


class Score(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def make_set(self, name, benchmark, batch, runs):
        directory = os.path.join(self.dir, name)
        os.makedirs(directory)
        for i, (samples, minutes, status) in enumerate(runs):
            synthetic(benchmark, os.path.join(directory, f"result_{i}.txt"), "--samples", samples, "--minutes",
                      minutes, "--batch", batch, "--status", status, "--start-ms", 1732000000000 + i * 10**8)
        return directory

    def test_score_matches_the_rcp_checker_and_summarizer(self):
        for name, (benchmark, batch, runs) in SETS.items():
            with self.subTest(set=name):
                directory = self.make_set(name, benchmark, batch, runs)
                result = forge_score(directory)
                self.assertIn(f"benchmark: {benchmark} at global batch {batch}", result.stdout, result.stderr)
                factor, score, passed, message = parse_summary(result.stdout)
                self.assertEqual(result.returncode, 0 if passed else 1, result.stdout + result.stderr)

                expected_pass, expected_message, expected_factor = rcp_checker.check_directory(
                    directory, "training", RULESET, False, False, rcp_pass="pruned_rcps", set_scaling=True)
                self.assertEqual(passed, expected_pass, message)
                self.assertEqual(message, expected_message)
                self.assertAlmostEqual(factor, expected_factor, delta=2e-6)
                if expected_pass:
                    summary_score, _, scaling = result_summarizer._compute_strong_score_standalone(
                        benchmark, "synthetic", False, directory, "training", RULESET)
                    self.assertAlmostEqual(scaling, expected_factor if expected_factor > 1 else 1.0, delta=1e-9)
                    self.assertAlmostEqual(score, summary_score, delta=1e-3)

    def test_fewer_runs_than_the_rules_warn(self):
        runs = [(3072, 20 + i, "success") for i in range(5)]
        directory = self.make_set("five", "llama2_70b_lora", 8, runs)
        result = forge_score(directory, "--benchmark", "llama2_70b_lora")
        self.assertIn("the rules require 10 for llama2_70b_lora", result.stderr)
        self.assertIn("runs: 5 (5 converged; the olympic mean averages 3)", result.stdout)
        self.assertIn("mean time-to-train: 22.0000 minutes", result.stdout)

    def test_unscorable_sets_are_errors(self):
        two = self.make_set("two", "llama2_70b_lora", 8, [(3072, 20, "success"), (3072, 21, "success")])
        result = forge_score(two)
        self.assertEqual(result.returncode, 1)
        self.assertIn("needs at least 3", result.stderr)

        aborted = self.make_set("aborted", "llama2_70b_lora", 8,
                                [(3072, 20 + i, "success") for i in range(8)] + [(3072, 30, "aborted")] * 2)
        result = forge_score(aborted)
        self.assertEqual(result.returncode, 1)
        self.assertIn("2 of 10 runs did not converge", result.stderr)

        wrong = self.make_set("wrong", "llama2_70b_lora", 8, [(3072, 20 + i, "success") for i in range(3)])
        result = forge_score(wrong, "--benchmark", "llama31_8b")
        self.assertEqual(result.returncode, 1)
        self.assertIn("submission_benchmark 'llama2_70b_lora', but --benchmark is 'llama31_8b'", result.stderr)

        empty = os.path.join(self.dir, "empty")
        os.makedirs(empty)
        result = forge_score(empty)
        self.assertEqual(result.returncode, 1)
        self.assertIn("holds no result_*.txt files", result.stderr)

    def test_malformed_line_names_file_and_line(self):
        directory = self.make_set("bad", "llama2_70b_lora", 8, [(3072, 20 + i, "success") for i in range(3)])
        path = os.path.join(directory, "result_1.txt")
        with open(path) as f:
            lines = f.read().splitlines()
        lines[4] = lines[4][:-7]  # cut the JSON short
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        result = forge_score(directory)
        self.assertEqual(result.returncode, 1)
        self.assertIn(f"{path}:5: the text after ':::MLLOG ' is not valid JSON", result.stderr)


class HtmlReport(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def make_set(self, name, runs, *options):
        directory = os.path.join(self.dir, name)
        os.makedirs(directory)
        for i, (samples, minutes) in enumerate(runs):
            synthetic("llama2_70b_lora", os.path.join(directory, f"result_{i}.txt"), "--samples", samples,
                      "--minutes", minutes, "--set", f"seed={7000 + i}", "--throughput", 10 + i,
                      "--start-ms", 1732000000000 + i * 10**8, *options)
        return directory

    def report(self, directory, expected_status):
        page = os.path.join(self.dir, os.path.basename(directory) + ".html")
        result = forge_score(directory, "--html", page)
        self.assertEqual(result.returncode, expected_status, result.stdout + result.stderr)
        with open(page) as f:
            html = f.read()
        ET.fromstring(html)  # well-formed
        return result, html

    def test_report_holds_every_run_the_summary_and_the_eval_chart(self):
        directory = self.make_set("full", [(3072 + 384 * (i % 2), 20 + i) for i in range(5)], "--tracked-stats", "all")
        result, html = self.report(directory, 0)
        for line in result.stdout.splitlines():
            label, _, text = line.partition(": ")
            if label in ("runs", "mean time-to-train", "samples to converge", "RCP check", "normalization factor",
                         "score"):
                self.assertIn(f"<tr><th>{label}</th><td>{text}</td></tr>", html)
        self.assertIn("<tr><th>score</th>", html)
        for i in range(5):
            # seed, the means of the tracked_stats members: S samples/s, S x 1024 tokens/s/GPU,
            # that x 6 x 8e9 / 1e12 TFLOP/s/GPU (forge_mllog_synthetic)
            tokens = (10 + i) * 1024
            self.assertIn(f"result_{i}.txt</td><td class=\"num\">{7000 + i}</td>", html)
            self.assertIn(f"<td class=\"num\">{10 + i}.00</td><td class=\"num\">{tokens:,}</td>"
                          f"<td class=\"num\">{tokens * 6 * 8e9 / 1e12:.1f}</td></tr>", html)
        self.assertEqual(html.count("<svg "), 1)
        self.assertEqual(html.count("<polyline "), 5)
        self.assertIn(">target 0.925</text>", html)

    def test_report_of_a_failing_set_and_of_older_logs(self):
        # Converging in fewer samples than the RCP allows: the check fails, the page is written.
        directory = self.make_set("too_fast", [(1536, 20 + i) for i in range(4)])
        result, html = self.report(directory, 1)
        self.assertIn("RCP check: FAILED", result.stdout)
        self.assertIn("<tr><th>RCP check</th><td>FAILED", html)
        # tracked_stats with throughput only: the other two columns say "-".
        self.assertIn("<td class=\"num\">10.00</td><td class=\"num\">-</td><td class=\"num\">-</td></tr>", html)

    def test_report_of_too_few_runs_says_why_there_is_no_score(self):
        directory = self.make_set("two", [(3072, 20), (3456, 21)])
        result, html = self.report(directory, 1)
        self.assertIn("needs at least 3", result.stderr)
        self.assertIn("No score: 2 runs: the olympic mean drops the fastest and the slowest", html)
        self.assertIn("result_1.txt", html)
        self.assertEqual(html.count("<polyline "), 2)

    def test_unwritable_report_is_an_error_naming_the_file(self):
        directory = self.make_set("set", [(3072, 20 + i) for i in range(3)])
        page = os.path.join(self.dir, "missing", "report.html")
        result = forge_score(directory, "--html", page)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f"cannot write the HTML report '{page}'", result.stderr)
        self.assertFalse(os.path.exists(os.path.dirname(page)))


if __name__ == "__main__":
    unittest.main()
