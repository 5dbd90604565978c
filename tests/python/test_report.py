"""forge report end to end: the page for real training runs (plus one with every optional
metric, from forge_write_metrics, and a bench.json) parses as strict XML, holds each run's
series, tables and benchmark rows, escapes names, fetches nothing; bad run directories
are clear errors that leave no output file."""
import json
import os
import shutil
import subprocess
import unittest
import xml.etree.ElementTree as ET

from forge_test_util import forge_bin, run, scratch_dir, tool

SVG = "{http://www.w3.org/2000/svg}"
ODD_NAME = 'odd <b>&"name\''

BENCH = [
    {"model": "llama3.1-8b", "precision": "bf16", "micro_batch": 2, "seq_len": 8192, "grad_accum": 1,
     "global_batch": 2, "n_gpus": 1, "parallelism": "single", "activation_checkpoint": "none",
     "step_time_median_s": 2.93, "tokens_per_s_per_gpu": 5592.4, "tflops_per_gpu": 312.7, "mfu": 0.316,
     "peak_memory_bytes": 71234567890, "status": "ok"},
    {"model": "llama3.1-8b", "precision": "bf16", "micro_batch": 4, "seq_len": 8192, "status": "oom",
     "error": "CUDA out of memory <tried 3.5 GiB>"},
]


def forge(*args, cwd=None):
    return subprocess.run([forge_bin(), *args], capture_output=True, text=True, cwd=cwd)


def train_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["type"] == "train"]


def text_of(element):
    return "".join(element.itertext())


class Report(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = scratch_dir()
        cls.tiny = os.path.join(cls.root, "tiny")
        cls.odd = os.path.join(cls.root, ODD_NAME)
        cls.synthetic = os.path.join(cls.root, "synthetic")
        run([forge_bin(), "train", "--training.steps", "8", "--eval.interval", "4", "--logging.run_dir", cls.tiny])
        run([forge_bin(), "train", "--training.steps", "5", "--training.local_batch_size", "4",
             "--training.gradient_accumulation_steps", "2", "--logging.run_dir", cls.odd])
        run([tool("forge_write_metrics"), cls.synthetic, "12"])
        with open(os.path.join(cls.tiny, "bench.json"), "w") as f:
            json.dump(BENCH, f)

    def report(self, *dirs):
        output = os.path.join(scratch_dir(), "report.html")
        result = forge("report", *dirs, "--output", output)
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(output, encoding="utf-8") as f:
            html = f.read()
        return html, ET.fromstring(html)

    def test_page_of_three_runs(self):
        html, page = self.report(self.tiny, self.odd, self.synthetic)
        self.assertTrue(html.startswith("<!DOCTYPE html>"))
        self.assertEqual(page.tag, "html")
        self.assertIn("tiny", text_of(page.find("head/title")))

        # Charts: loss, tokens/s, TFLOP/s and memory (the synthetic run measured it); a line
        # per run in each, the memory line only for the synthetic run; validation loss as
        # dots: tiny at steps 4 and 8, the odd run after its last step, synthetic at 5, 10.
        figures = page.findall(".//figure")
        self.assertEqual([text_of(f.find("figcaption")) for f in figures],
                         ["Loss (lines: training, dots: validation)", "Tokens per second",
                          "Model TFLOP/s per device", "Peak device memory"])
        lines = [len(f.findall(f".//{SVG}polyline")) for f in figures]
        self.assertEqual(lines, [3, 3, 3, 1])
        self.assertEqual(len(figures[0].findall(f".//{SVG}circle")), 5)
        tiny_line = figures[0].findall(f".//{SVG}polyline")[0]
        self.assertEqual(len(tiny_line.get("points").split()), 8)

        # The runs table: a row per run with its final loss and median step time.
        rows = page.findall(".//table[@class='runs']/tr")[1:]
        self.assertEqual(len(rows), 3)
        tiny_cells = [text_of(td) for td in rows[0].findall("td")]
        train = train_records(self.tiny)
        self.assertIn("debug-tiny", tiny_cells[1])
        self.assertEqual(tiny_cells[6], f"{train[-1]['loss']:.4f}")
        self.assertEqual(tiny_cells[4], "8 \u00d7 128")
        self.assertIn("4 micro \u00d7 2 accum", text_of(rows[1]))
        synthetic_cells = [text_of(td) for td in rows[2].findall("td")]
        self.assertEqual(synthetic_cells[10], "6.5%")  # median MFU of steps 1..12 at s / 100
        self.assertEqual(synthetic_cells[12], "12.00 GiB")

        # The benchmark table of the run that has a bench.json, and only that one.
        headings = [text_of(h) for h in page.findall(".//h2")]
        self.assertEqual([h for h in headings if h.startswith("Benchmark")], ["Benchmark: tiny"])
        bench_rows = page.findall(".//table[@class='bench']/tr")[1:]
        self.assertEqual(len(bench_rows), 2)
        self.assertIn("312.7", text_of(bench_rows[0]))
        self.assertIn("5,592", text_of(bench_rows[0]))
        self.assertIn("66.34 GiB", text_of(bench_rows[0]))
        self.assertIn("CUDA out of memory <tried 3.5 GiB>", text_of(bench_rows[1]))

        # Names from the file system come back exactly, so they were escaped; nothing is
        # fetched from anywhere.
        self.assertIn(ODD_NAME, [text_of(span) for span in page.findall(".//div[@class='legend']/span")])
        self.assertNotIn("<b>", html)
        for element in page.iter():
            self.assertNotIn(element.tag, ("script", "link", "img", "iframe"))
            self.assertIsNone(element.get("src"))
            self.assertIsNone(element.get("href"))

    def test_default_output_in_the_current_directory(self):
        cwd = scratch_dir()
        result = forge("report", self.tiny, cwd=cwd)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertTrue(os.path.isfile(os.path.join(cwd, "report.html")))
        self.assertEqual(os.listdir(cwd), ["report.html"])

    def expect_error(self, dirs, *fragments, output=None):
        output = output or os.path.join(scratch_dir(), "report.html")
        result = forge("report", *dirs, "--output", output)
        self.assertNotEqual(result.returncode, 0, f"{dirs} should fail")
        for fragment in fragments:
            self.assertIn(fragment, result.stderr)
        return output

    def test_missing_run_directory(self):
        missing = os.path.join(self.root, "no-such-run")
        output = self.expect_error([self.tiny, missing], missing, "not found")
        self.assertFalse(os.path.exists(output))
        self.assertEqual(os.listdir(os.path.dirname(output)), [])

    def test_directory_without_metrics(self):
        empty = scratch_dir()
        output = self.expect_error([empty], empty, "no metrics.jsonl (nor bench.json)")
        self.assertFalse(os.path.exists(output))

    def test_malformed_line_names_file_and_line(self):
        broken = os.path.join(scratch_dir(), "broken")
        shutil.copytree(self.tiny, broken)
        metrics = os.path.join(broken, "metrics.jsonl")
        with open(metrics) as f:
            lines = f.readlines()
        lines.insert(3, '{"type": "train", "step": 3, "loss": \n')
        with open(metrics, "w") as f:
            f.writelines(lines)
        output = self.expect_error([broken], f"{metrics}:4", "not valid JSON")
        self.assertFalse(os.path.exists(output))

    def test_failed_report_keeps_the_previous_one(self):
        output = os.path.join(scratch_dir(), "kept.html")
        with open(output, "w") as f:
            f.write("previous report")
        self.expect_error([self.tiny, os.path.join(self.root, "no-such-run")], "no-such-run", output=output)
        with open(output) as f:
            self.assertEqual(f.read(), "previous report")

    def test_output_that_is_a_directory(self):
        directory = scratch_dir()
        self.expect_error([self.tiny], directory, "is a directory", output=directory)

    def test_bad_bench_json(self):
        bad = os.path.join(scratch_dir(), "bad-bench")
        shutil.copytree(self.tiny, bad)
        with open(os.path.join(bad, "bench.json"), "w") as f:
            json.dump([{"model": "x", "status": "ok", "tflops_per_gpu": "fast"}], f)
        self.expect_error([bad], "bench.json entry 1", "tflops_per_gpu")

    def test_bench_output_directory(self):
        # forge bench --output-dir: bench.json beside one run directory per benchmarked run.
        bench = os.path.join(scratch_dir(), "bench")
        os.makedirs(bench)
        with open(os.path.join(bench, "bench.json"), "w") as f:
            json.dump(BENCH, f)
        _, page = self.report(bench, self.synthetic)
        self.assertEqual(len(page.findall(".//table[@class='runs']/tr")), 2)
        self.assertIn("Benchmark: bench", [text_of(h) for h in page.findall(".//h2")])
        self.assertEqual(len(page.findall(".//table[@class='bench']/tr")), 3)

    def test_no_run_directory(self):
        result = forge("report")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("RUN_DIR", result.stderr)


if __name__ == "__main__":
    unittest.main()
