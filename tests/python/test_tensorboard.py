"""forge's TensorBoard event files, read back with TensorBoard's own reader (EventAccumulator,
tensorboard PyPI package): every scalar at every step equals what metrics.jsonl holds
(rounded to float32, as TensorBoard stores it), for a real training run, for a writer with
MFU and memory set, and for a resumed run whose stale steps TensorBoard must drop."""
import glob
import json
import os
import struct
import unittest

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from forge_test_util import forge_bin, run, scratch_dir, tool

GIB = 2.0 ** 30


def float32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected_scalars(run_dir):
    """tag -> {step: value} from metrics.jsonl, as NOTE [TensorBoard scalars] maps it. A
    resume record drops the records past its step, as the resumed run supersedes them."""
    expected = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            if r["type"] == "resume":
                for series in expected.values():
                    for step in [s for s in series if s > r["step"]]:
                        del series[step]
            if r["type"] == "train":
                values = {"train/loss": r["loss"], "train/lr": r["lr"], "train/grad_norm": r["grad_norm"],
                          "throughput/tokens_per_s": r["tokens_per_s"],
                          "throughput/model_tflops": r["model_tflops"]}
                if r["mfu"] is not None:
                    values["throughput/mfu_percent"] = r["mfu"] * 100.0
                if "peak_memory_bytes" in r:
                    values["memory/peak_gib"] = r["peak_memory_bytes"] / GIB
            elif r["type"] == "eval":
                values = {"eval/loss": r["loss"], "eval/perplexity": r["perplexity"]}
            else:
                continue
            for tag, value in values.items():
                expected.setdefault(tag, {})[r["step"]] = float32(value)
    return expected


def tensorboard_scalars(run_dir):
    """tag -> {step: value} as TensorBoard loads the directory; each step must appear once."""
    accumulator = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    scalars = {}
    for tag in accumulator.Tags()["scalars"]:
        events = accumulator.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: steps logged more than once: {steps}"
        scalars[tag] = {e.step: e.value for e in events}
    return scalars


def forge_train(*args):
    return run([forge_bin(), "train", *args])


class TensorBoardEvents(unittest.TestCase):
    def assert_matches_metrics(self, run_dir):
        expected = expected_scalars(run_dir)
        actual = tensorboard_scalars(run_dir)
        self.assertEqual(sorted(actual), sorted(expected))
        for tag in expected:
            self.assertEqual(actual[tag], expected[tag], tag)
        return actual

    def test_training_run(self):
        run_dir = os.path.join(scratch_dir(), "run")
        forge_train("--training.steps", "20", "--eval.interval", "10", "--logging.run_dir", run_dir)
        files = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
        self.assertEqual(len(files), 1)
        self.assertRegex(os.path.basename(files[0]), r"^events\.out\.tfevents\.\d+\.\S+$")
        scalars = self.assert_matches_metrics(run_dir)
        self.assertEqual(sorted(scalars["train/loss"]), list(range(1, 21)))
        self.assertEqual(sorted(scalars["eval/loss"]), [10, 20])
        self.assertNotIn("throughput/mfu_percent", scalars)  # the CPU has no known peak

    def test_file_version_and_wall_time(self):
        run_dir = os.path.join(scratch_dir(), "run")
        forge_train("--training.steps", "2", "--logging.run_dir", run_dir)
        accumulator = EventAccumulator(run_dir)
        accumulator.Reload()
        self.assertEqual(accumulator.file_version, 2.0)
        (path,) = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
        started = int(path.split("events.out.tfevents.")[1].split(".")[0])
        wall_times = [e.wall_time for e in accumulator.Scalars("train/loss")]
        self.assertTrue(all(started <= t < started + 600 for t in wall_times), wall_times)

    def test_every_optional_scalar(self):
        run_dir = os.path.join(scratch_dir(), "run")
        run([tool("forge_write_metrics"), run_dir, "12"])
        scalars = self.assert_matches_metrics(run_dir)
        self.assertEqual(scalars["memory/peak_gib"][3], float32(3 + 3 / GIB))
        self.assertEqual(scalars["throughput/mfu_percent"][7], float32(7.0))
        self.assertEqual(sorted(scalars["eval/perplexity"]), [5, 10])

    def test_resumed_run_replaces_the_steps_after_its_checkpoint(self):
        run_dir = os.path.join(scratch_dir(), "run")
        common = ["--logging.run_dir", run_dir, "--checkpoint.enable", "true", "--checkpoint.interval", "4",
                  "--eval.interval", "0"]
        forge_train("--training.steps", "10", *common)
        # As if the first run had been interrupted after step 10 with its last checkpoint
        # at step 4: steps 5..10 of the first file are stale once the run resumes there.
        forge_train("--training.steps", "12", "--checkpoint.load_step", "4", *common)
        self.assertEqual(len(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))), 2)
        scalars = self.assert_matches_metrics(run_dir)
        self.assertEqual(sorted(scalars["train/loss"]), list(range(1, 13)))

    def test_disabled(self):
        run_dir = os.path.join(scratch_dir(), "run")
        forge_train("--training.steps", "1", "--logging.enable_tensorboard", "false", "--logging.run_dir", run_dir)
        self.assertEqual(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")), [])
        self.assertTrue(os.path.isfile(os.path.join(run_dir, "metrics.jsonl")))


if __name__ == "__main__":
    unittest.main()
