"""forge train on instruction data (data.source sft), end to end: a small model learns a
masked response task, packed and padded; a run stopped and resumed from a checkpoint gives
bitwise the losses of the uninterrupted run (the loader position is what the checkpoint
saves); over-long examples are counted once in the log; a damaged mask stops the run naming
the file."""
import json
import os
import random
import shutil
import subprocess
import unittest

from forge_test_util import forge_bin, run, scratch_dir, tool, train_losses

COMMON = ["--data.source", "sft", "--data.split", "1", "--eval.interval", "0", "--training.seq_len", "32",
          "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_steps", "30",
          "--logging.log_interval", "1"]


def write_indexed(prefix, dtype, sequences, folder):
    spec = os.path.join(folder, os.path.basename(prefix) + ".json")
    with open(spec, "w") as f:
        json.dump({"dtype": dtype, "documents": [[s] for s in sequences]}, f)
    run([tool("forge_write_indexed"), prefix, spec])


def write_task(folder, count=160, seed=3):
    """Reverse two tokens: prompt [1, x, y, 2], response [y, x, 3], loss on the response."""
    rng = random.Random(seed)
    tokens, masks = [], []
    for _ in range(count):
        x, y = rng.randrange(4, 32), rng.randrange(4, 32)
        tokens.append([1, x, y, 2, y, x, 3])
        masks.append([0, 0, 0, 0, 1, 1, 1])
    prefix = os.path.join(folder, "task")
    write_indexed(prefix, "int32", tokens, folder)
    write_indexed(prefix + ".mask", "uint8", masks, folder)
    return prefix


def forge(*args):
    return subprocess.run([forge_bin(), "train", *args], capture_output=True, text=True)


class TrainOnSft(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = scratch_dir()
        cls.addClassCleanup(shutil.rmtree, cls.root, ignore_errors=True)
        cls.prefix = write_task(cls.root)

    def train(self, name, *extra):
        run_dir = os.path.join(self.root, name)
        result = forge("--data.path", self.prefix, "--logging.run_dir", run_dir, *COMMON, *extra)
        self.assertEqual(result.returncode, 0, result.stderr + result.stdout)
        return run_dir, result

    def test_the_response_is_learned_packed_and_padded(self):
        # A packed sample of 33 tokens holds four 7-token examples: padded batches four times
        # as large see as many examples per step.
        for packing, batch in (("packed", "4"), ("padded", "16")):
            run_dir, _ = self.train("learn-" + packing, "--data.packing", packing, "--training.steps", "30",
                                    "--training.local_batch_size", batch)
            losses = train_losses(run_dir)
            self.assertEqual(len(losses), 30)
            self.assertLess(sum(losses[-5:]) / 5, 0.8 * sum(losses[:5]) / 5, f"{packing}: {losses}")

    def test_resume_gives_the_uninterrupted_losses(self):
        whole, _ = self.train("whole", "--training.steps", "12", "--checkpoint.enable", "true",
                              "--checkpoint.interval", "4")
        resumed = os.path.join(self.root, "resumed")
        shutil.copytree(os.path.join(whole, "checkpoints", "step-8"), os.path.join(resumed, "checkpoints", "step-8"))
        self.train("resumed", "--training.steps", "12", "--checkpoint.enable", "true", "--checkpoint.interval", "4")
        self.assertEqual(train_losses(resumed), train_losses(whole)[8:])

    def test_overlong_examples_are_counted_once(self):
        _, result = self.train("short", "--training.seq_len", "5", "--training.steps", "2")
        lines = [line for line in (result.stdout + result.stderr).splitlines() if "over seq_len + 1" in line]
        self.assertEqual(len(lines), 1, result.stdout)
        self.assertIn("160 examples over seq_len + 1 = 6 tokens truncated", lines[0])
        dropped = forge("--data.path", self.prefix, "--logging.run_dir", os.path.join(self.root, "dropped"), *COMMON,
                        "--training.seq_len", "5", "--data.overlong", "drop", "--training.steps", "2")
        self.assertNotEqual(dropped.returncode, 0)
        self.assertIn("keeps no example", dropped.stderr + dropped.stdout)

    def test_a_damaged_mask_names_the_file(self):
        folder = os.path.join(self.root, "damaged")
        os.makedirs(folder)
        prefix = write_task(folder, count=8)
        with open(prefix + ".mask.bin", "r+b") as f:
            f.seek(10)
            f.write(b"\x07")
        result = forge("--data.path", prefix, "--logging.run_dir", os.path.join(folder, "run"), *COMMON,
                       "--training.steps", "2")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("task.mask.bin: byte offset 10", result.stderr + result.stdout)
        self.assertFalse(os.path.exists(os.path.join(folder, "run", "metrics.jsonl")))


if __name__ == "__main__":
    unittest.main()
