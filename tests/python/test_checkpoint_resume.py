"""forge train with checkpoints, end to end: a run stopped at step k and resumed gives
bitwise the losses of the uninterrupted run; a run killed at random moments always leaves
checkpoints that load and resumes from the newest; damaged or mismatched checkpoints stop
forge with the file and the tensor named, leaving the run directory as it was."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
import unittest

from forge_test_util import forge_bin, scratch_dir, train_losses

TINY = ["--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_steps", "9", "--eval.interval", "0"]
# Large enough that writing a checkpoint takes about as long as a training step.
SLOW_SAVE = ["--model.hidden_size", "512", "--model.ffn_hidden_size", "2048", "--training.seq_len", "16",
             "--training.local_batch_size", "1", "--eval.interval", "0", "--logging.log_interval", "1"]


def scratch(case):
    """A scratch directory removed when the test (or, given a class, the class) is done:
    checkpoints are large."""
    path = scratch_dir()
    if isinstance(case, type):
        case.addClassCleanup(shutil.rmtree, path, ignore_errors=True)
    else:
        case.addCleanup(shutil.rmtree, path, ignore_errors=True)
    return path


def forge(*args):
    return subprocess.run([forge_bin(), "train", *args], capture_output=True, text=True)


def steps_in(folder):
    if not os.path.isdir(folder):
        return []
    return sorted(int(name[5:]) for name in os.listdir(folder) if name.startswith("step-"))


def tensor_piece(step_dir, name, state):
    with open(os.path.join(step_dir, "metadata.json")) as f:
        for tensor in json.load(f)["tensors"]:
            if tensor["name"] == name and tensor["state"] == state:
                return tensor["pieces"][0]
    raise KeyError(name)


def snapshot(run_dir):
    contents = {}
    for name in ("metrics.jsonl", "config.yaml"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                contents[name] = f.read()
    return contents


def checkpoint_files(folder):
    """{step-N/file: contents} of every checkpoint in folder: the shard files' bytes, and
    the metadata but for the experiment's YAML (whose run directory and checkpoint keys
    differ from run to run)."""
    files = {}
    for step in steps_in(folder):
        directory = os.path.join(folder, f"step-{step}")
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), "rb") as f:
                contents = f.read()
            if name == "metadata.json":
                contents = json.loads(contents)
                del contents["experiment_config"]
            files[f"step-{step}/{name}"] = contents
    return files


class AsyncSaves(unittest.TestCase):
    """checkpoint.async_mode async: the losses and the checkpoints are bitwise those of
    synchronous saves, a run resumed from an asynchronous save is exact, and a tiny
    checkpoint.buffer_mb streams the same bytes."""

    @classmethod
    def setUpClass(cls):
        cls.root = scratch(cls)
        cls.runs = {}
        for name, extra in (("sync", []), ("async", ["--checkpoint.async_mode", "async"]),
                            ("small_buffer", ["--checkpoint.buffer_mb", "1"])):
            run_dir = os.path.join(cls.root, name)
            result = forge("--training.steps", "12", "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                           "--checkpoint.interval", "4", *TINY, *extra)
            assert result.returncode == 0, result.stderr
            cls.runs[name] = (run_dir, result)

    def test_async_saves_leave_losses_and_checkpoints_bitwise_unchanged(self):
        sync_dir, _ = self.runs["sync"]
        async_dir, result = self.runs["async"]
        self.assertEqual(train_losses(async_dir), train_losses(sync_dir))
        self.assertIn("asynchronous: the step loop waited", result.stdout)
        want = checkpoint_files(os.path.join(sync_dir, "checkpoints"))
        self.assertEqual(sorted(want), sorted(checkpoint_files(os.path.join(async_dir, "checkpoints"))))
        self.assertTrue(want == checkpoint_files(os.path.join(async_dir, "checkpoints")))
        self.assertEqual(steps_in(os.path.join(async_dir, "checkpoints")), [4, 8, 12])

    def test_buffer_size_does_not_change_the_bytes(self):
        sync_dir, result = self.runs["sync"]
        small_dir, small = self.runs["small_buffer"]
        self.assertIn("peak host staging 1.0 MiB", small.stdout)
        self.assertTrue(checkpoint_files(os.path.join(sync_dir, "checkpoints")) ==
                        checkpoint_files(os.path.join(small_dir, "checkpoints")))

    def test_resume_from_an_async_save_is_exact(self):
        async_dir, _ = self.runs["async"]
        run_dir = os.path.join(scratch(self), "resumed")
        shutil.copytree(os.path.join(async_dir, "checkpoints", "step-8"), os.path.join(run_dir, "checkpoints", "step-8"))
        result = forge("--training.steps", "12", "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                       "--checkpoint.interval", "4", "--checkpoint.async_mode", "async", *TINY)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(train_losses(run_dir), train_losses(self.runs["sync"][0])[8:])
        self.assertIn("peak host staging", result.stdout)

    def test_bad_async_mode_and_buffer_are_refused(self):
        for key, value, expected in (("checkpoint.async_mode", "sometimes", "disabled"),
                                     ("checkpoint.buffer_mb", "0", "checkpoint.buffer_mb")):
            result = forge("--training.steps", "1", "--logging.run_dir", os.path.join(scratch(self), "bad"),
                           f"--{key}", value, *TINY)
            self.assertNotEqual(result.returncode, 0)
            self.assertIn(key, result.stderr)
            self.assertIn(expected, result.stderr)


# 16 M parameters: a 190 MB checkpoint, 190 times checkpoint.buffer_mb 1.
LARGE_SHARD = ["--model.hidden_size", "512", "--model.ffn_hidden_size", "2048", "--model.num_layers", "4",
               "--training.seq_len", "16", "--training.local_batch_size", "1", "--eval.interval", "0",
               "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.buffer_mb", "1"]


def resident_growths(log):
    """The 'process peak resident memory +X MiB' of every save and load in a log."""
    return [float(x) for x in re.findall(r"process peak resident memory \+([0-9.]+) MiB", log)]


class BoundedHostMemory(unittest.TestCase):
    """A save and a resume of a checkpoint 190 times the buffer raise the process's peak
    resident memory by about the buffer (NOTE [Streaming checkpoints])."""

    def test_save_and_resume_stage_the_buffer_not_the_shard(self):
        run_dir = os.path.join(scratch(self), "run")
        first = forge("--training.steps", "1", "--logging.run_dir", run_dir, *LARGE_SHARD)
        self.assertEqual(first.returncode, 0, first.stderr)
        second = forge("--training.steps", "2", "--logging.run_dir", run_dir, *LARGE_SHARD)
        self.assertEqual(second.returncode, 0, second.stderr)
        size_mb = float(re.search(r"\(([0-9.]+) MB in", first.stdout).group(1))
        self.assertGreater(size_mb, 150)
        self.assertIn("peak host staging 1.0 MiB", first.stdout)
        growths = resident_growths(first.stdout + second.stdout)
        if not growths and "peak host staging" in first.stdout:
            self.skipTest("/proc/self/clear_refs cannot be written here: no peak resident memory to measure")
        self.assertEqual(len(growths), 3, first.stdout + second.stdout)  # save, resume, save
        for growth in growths:
            self.assertLess(growth, 12.0, f"a {size_mb} MB checkpoint through a 1 MiB buffer")


class ExactResume(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.full = os.path.join(scratch(cls), "full")
        result = forge("--training.steps", "12", "--logging.run_dir", cls.full, "--checkpoint.enable", "true",
                       "--checkpoint.interval", "6", *TINY)
        assert result.returncode == 0, result.stderr
        cls.full_losses = train_losses(cls.full)

    def test_stop_and_resume_in_the_same_run_directory(self):
        run_dir = os.path.join(scratch(self), "run")
        common = ["--logging.run_dir", run_dir, "--checkpoint.enable", "true", "--checkpoint.interval", "6", *TINY]
        self.assertEqual(forge("--training.steps", "6", *common).returncode, 0)
        result = forge("--training.steps", "12", *common)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("resuming from checkpoint", result.stdout)
        self.assertIn("step-6", result.stdout)
        self.assertIn("appending to", result.stdout)
        self.assertEqual(len(self.full_losses), 12)
        self.assertEqual(train_losses(run_dir), self.full_losses)
        self.assertEqual(steps_in(os.path.join(run_dir, "checkpoints")), [6, 12])

    def test_copied_checkpoint_resumes_in_a_new_run_directory(self):
        run_dir = os.path.join(scratch(self), "copy")
        shutil.copytree(os.path.join(self.full, "checkpoints", "step-6"), os.path.join(run_dir, "checkpoints", "step-6"))
        result = forge("--training.steps", "12", "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                       "--checkpoint.interval", "6", *TINY)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(train_losses(run_dir), self.full_losses[6:])

    def test_load_step_picks_an_older_checkpoint(self):
        run_dir = os.path.join(scratch(self), "older")
        shutil.copytree(os.path.join(self.full, "checkpoints"), os.path.join(run_dir, "checkpoints"))
        result = forge("--training.steps", "12", "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                       "--checkpoint.load_step", "6", "--checkpoint.interval", "100", *TINY)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("step-6", result.stdout)
        self.assertEqual(train_losses(run_dir), self.full_losses[6:])

    def test_initial_load_path_starts_fine_tuning_from_the_weights(self):
        run_dir = os.path.join(scratch(self), "finetune")
        weights = os.path.join(self.full, "checkpoints", "step-12")
        result = forge("--training.steps", "2", "--logging.run_dir", run_dir, "--checkpoint.initial_load_path",
                       weights, *TINY)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("initial weights from checkpoint", result.stdout)
        losses = train_losses(run_dir)
        self.assertEqual(len(losses), 2)
        self.assertLess(losses[0], self.full_losses[0] - 0.3, "the loaded weights should start well below a fresh model")

    def test_existing_run_without_checkpoint_is_refused(self):
        run_dir = os.path.join(scratch(self), "run")
        self.assertEqual(forge("--training.steps", "1", "--logging.run_dir", run_dir, *TINY).returncode, 0)
        before = snapshot(run_dir)
        result = forge("--training.steps", "2", "--logging.run_dir", run_dir, *TINY)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("already holds a run", result.stderr)
        self.assertEqual(snapshot(run_dir), before)
        # With checkpoints on, a run directory without one is a requeued attempt that died
        # before its first checkpoint: it starts afresh.
        result = forge("--training.steps", "2", "--logging.run_dir", run_dir, "--checkpoint.enable", "true", *TINY)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("starting the run afresh", result.stderr)

    def test_checkpoint_keys_that_need_more(self):
        result = forge("--checkpoint.load_step", "3")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("checkpoint.enable", result.stderr)
        result = forge("--checkpoint.initial_load_in_hf", "true")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("checkpoint.initial_load_in_hf", result.stderr)
        self.assertIn("Hugging Face", result.stderr)


class DamagedCheckpoint(unittest.TestCase):
    """A run stopped at step 6 whose checkpoint is then damaged: resuming must fail,
    naming the file and tensor, and leave metrics.jsonl and config.yaml untouched."""

    def setUp(self):
        self.run_dir = os.path.join(scratch(self), "run")
        self.args = ["--training.steps", "12", "--logging.run_dir", self.run_dir, "--checkpoint.enable", "true",
                     "--checkpoint.interval", "6", *TINY]
        result = forge("--training.steps", "6", *self.args[2:])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.step_dir = os.path.join(self.run_dir, "checkpoints", "step-6")
        self.shard = os.path.join(self.step_dir, "rank-0.bin")

    def expect_refused(self, extra, *fragments):
        before = snapshot(self.run_dir)
        result = forge(*self.args, *extra)
        self.assertNotEqual(result.returncode, 0, result.stdout)
        for fragment in fragments:
            self.assertIn(fragment, result.stderr)
        self.assertEqual(snapshot(self.run_dir), before)
        self.assertEqual(steps_in(os.path.join(self.run_dir, "checkpoints")), [6])

    def test_flipped_byte(self):
        piece = tensor_piece(self.step_dir, "layers.1.attention.o.weight", "exp_avg_sq")
        with open(self.shard, "r+b") as f:
            f.seek(piece["byte_offset"] + 3)
            byte = f.read(1)[0]
            f.seek(piece["byte_offset"] + 3)
            f.write(bytes([byte ^ 0x01]))
        self.expect_refused([], self.shard, "tensor 'layers.1.attention.o.weight' (exp_avg_sq)", "CRC-32")

    def test_truncated_shard(self):
        os.truncate(self.shard, os.path.getsize(self.shard) - 4)
        self.expect_refused([], self.shard, "shorter", "tensor 'output.weight' (exp_avg_sq)")

    def test_missing_metadata(self):
        os.remove(os.path.join(self.step_dir, "metadata.json"))
        self.expect_refused([], self.step_dir, "metadata.json", "no checkpoint in")

    def test_other_model(self):
        self.expect_refused(["--model.ffn_hidden_size", "128"], self.step_dir,
                            "tensor 'layers.0.mlp.gate_up.weight' (param)", "[384, 64]", "[256, 64]")


class KilledRuns(unittest.TestCase):
    STEPS = 8

    def test_sigkill_at_random_moments(self):
        seed = int(time.time())
        rng = random.Random(seed)
        print(f"kill test seed {seed}")
        run_dir = os.path.join(scratch(self), "run")
        folder = os.path.join(run_dir, "checkpoints")
        args = [forge_bin(), "train", "--training.steps", str(self.STEPS), "--logging.run_dir", run_dir,
                "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2",
                *SLOW_SAVE]
        for attempt in range(4):
            self.start_over_if_no_checkpoint(args, run_dir, folder)
            visible = steps_in(folder)
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            startup = self.read_until_training_starts(proc)
            if visible:
                self.assertIn(f"resuming from checkpoint '{folder}/step-{visible[-1]}'", startup)
            else:
                self.assertNotIn("resuming", startup)
            time.sleep(rng.uniform(0.3, 3.0))
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            unfinished = [name for name in os.listdir(folder) if name.startswith(".tmp-")] if os.path.isdir(folder) else []
            print(f"kill {attempt}: checkpoints {steps_in(folder)}, unfinished {unfinished}")
            self.check_every_visible_checkpoint_loads(folder)
            if proc.returncode == 0:
                break
        # On a loaded machine every kill may come before the first checkpoint is complete.
        self.start_over_if_no_checkpoint(args, run_dir, folder)
        final = subprocess.run(args, capture_output=True, text=True)
        self.assertEqual(final.returncode, 0, final.stderr)
        self.check_every_visible_checkpoint_loads(folder)
        self.assertEqual(steps_in(folder)[-1], self.STEPS)

        reference = os.path.join(scratch(self), "reference")
        result = forge("--training.steps", str(self.STEPS), "--logging.run_dir", reference, *SLOW_SAVE)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(train_losses(run_dir), train_losses(reference))

    def start_over_if_no_checkpoint(self, args, run_dir, folder):
        """A run killed before its first checkpoint starts afresh when started again (from
        step 0, appending to metrics.jsonl): nothing to clear away."""

    @staticmethod
    def read_until_training_starts(proc):
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("run directory:"):
                break
        return "".join(lines)

    def check_every_visible_checkpoint_loads(self, folder):
        for step in steps_in(folder):
            probe = os.path.join(scratch(self), "probe")
            result = forge("--training.steps", str(step), "--logging.run_dir", probe, "--checkpoint.enable", "true",
                           "--checkpoint.folder", folder, "--checkpoint.load_step", str(step), *SLOW_SAVE)
            self.assertEqual(result.returncode, 0, f"step-{step} does not load:\n{result.stderr}")
            self.assertIn("nothing left to train", result.stdout)


if __name__ == "__main__":
    unittest.main()
