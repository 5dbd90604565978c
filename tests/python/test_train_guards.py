"""forge train's guards, end to end: a NaN injected into one gradient (FORGE_TEST_INJECT_NAN)
stops the run naming the step, micro-batch and tensor, or is skipped leaving the weights and
AdamW's state bitwise as they were (one rank and two); SIGTERM / SIGINT finish the step, save
and exit 75 (ranks agree on the step even when only one got the signal), and the same
command resumes bitwise; a requeued run with no checkpoint yet starts afresh; a finished run
started again keeps its Hugging Face export; loss spikes (FORGE_TEST_SCALE_LOSS) are warned
about, skipped bitwise or stop the run, and a resumed run judges them as the uninterrupted one."""
import json
import os
import shutil
import signal
import subprocess
import time
import unittest

from forge_test_util import forge_bin, records, scratch_dir

TINY = ["--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_steps", "9", "--eval.interval", "0"]
TENSOR = "layers.1.attention.o.weight"
EXIT_STOPPED = 75
TIMEOUT = 120


def scratch(case):
    path = scratch_dir()
    case.addCleanup(shutil.rmtree, path, ignore_errors=True)
    return path


def forge(*args, env=None, ranks=1):
    command = [forge_bin(), "train", *args]
    if ranks > 1:
        command = [forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", "train",
                   "--parallelism.data_parallel_shard_degree", str(ranks), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT,
                          env=dict(os.environ, FORGE_NUM_THREADS="1", **(env or {})))



def train_losses(run_dir):
    losses = {}
    for r in records(run_dir):
        losses[r["step"]] = r["loss"]
    return [losses[s] for s in sorted(losses)]


def checkpoint_state(run_dir, step):
    """The shard files' bytes and the optimizer step count of checkpoint step-<step>."""
    folder = os.path.join(run_dir, "checkpoints", f"step-{step}")
    shards = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".bin"):
            with open(os.path.join(folder, name), "rb") as f:
                shards[name] = f.read()
    with open(os.path.join(folder, "metadata.json")) as f:
        metadata = json.load(f)
    return shards, metadata["optimizer"]["step"]


class NonFinite(unittest.TestCase):
    ACCUM = ["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "2"]

    def test_stop_names_step_micro_batch_and_tensor(self):
        run_dir = os.path.join(scratch(self), "run")
        result = forge("--training.steps", "5", "--logging.run_dir", run_dir, *self.ACCUM, *TINY,
                       env={"FORGE_TEST_INJECT_NAN": f"3:{TENSOR}:1"})
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("non-finite step 3", result.stderr)
        self.assertIn("micro-batch 1 of 2", result.stderr)
        self.assertIn(f"'{TENSOR}'", result.stderr)
        self.assertEqual([r["step"] for r in records(run_dir)], [1, 2])

    def test_stop_is_the_default_and_names_the_loss_when_the_forward_pass_fails(self):
        run_dir = os.path.join(scratch(self), "run")
        # An embedding gradient poisoned at step 1 makes step 2's weights... never: the step
        # stops first, so the run ends at step 1 with nothing trained.
        result = forge("--training.steps", "3", "--logging.run_dir", run_dir, *TINY,
                       env={"FORGE_TEST_INJECT_NAN": "1:embedding.weight"})
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("non-finite step 1", result.stderr)
        self.assertIn("micro-batch 0 of 1", result.stderr)
        self.assertIn("'embedding.weight'", result.stderr)

    def skip_run(self, ranks):
        run_dir = os.path.join(scratch(self), "run")
        result = forge("--training.steps", "4", "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                       "--checkpoint.interval", "1", "--training.on_nonfinite", "skip", *self.ACCUM, *TINY,
                       env={"FORGE_TEST_INJECT_NAN": f"3:{TENSOR}:0"}, ranks=ranks)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("step 3: loss", result.stderr)
        self.assertIn(f"first non-finite gradient '{TENSOR}'", result.stderr)
        self.assertIn("skipped", result.stderr)
        steps = records(run_dir)
        self.assertTrue(steps[2].get("skipped"))
        self.assertEqual(steps[2]["skipped_steps"], 1)
        self.assertNotIn("skipped", steps[3])
        self.assertIsNotNone(steps[3]["loss"])
        # Weights, both moments and AdamW's step count: bitwise those of step 2.
        before, after = checkpoint_state(run_dir, 2), checkpoint_state(run_dir, 3)
        self.assertEqual(before[1], after[1])
        self.assertEqual(before[0], after[0])
        self.assertNotEqual(checkpoint_state(run_dir, 4)[0], after[0])

    def test_skip_leaves_weights_and_optimizer_state_bitwise(self):
        self.skip_run(1)

    def test_skip_on_two_ranks(self):
        self.skip_run(2)

    def test_stop_on_two_ranks_names_the_accumulation_step(self):
        run_dir = os.path.join(scratch(self), "run")
        result = forge("--training.steps", "4", "--logging.run_dir", run_dir, "--training.local_batch_size", "2",
                       "--training.gradient_accumulation_steps", "2", *TINY,
                       env={"FORGE_TEST_INJECT_NAN": f"2:{TENSOR}:1"}, ranks=2)
        self.assertNotEqual(result.returncode, 0, result.stderr)
        self.assertIn("non-finite step 2", result.stderr)
        self.assertIn("accumulation step 1 of 2", result.stderr)
        self.assertIn(f"'{TENSOR}'", result.stderr)

    def test_too_many_skipped_steps_stop_the_run(self):
        run_dir = os.path.join(scratch(self), "run")
        result = forge("--training.steps", "4", "--logging.run_dir", run_dir, "--training.on_nonfinite", "skip",
                       "--training.max_skipped_steps", "1", *TINY, env={"FORGE_TEST_INJECT_NAN": f"2:{TENSOR}"})
        self.assertEqual(result.returncode, 1)
        self.assertIn("training.max_skipped_steps 1", result.stderr)
        self.assertEqual(len(records(run_dir)), 2)

    def test_bad_settings(self):
        result = forge("--training.on_nonfinite", "ignore")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("training.on_nonfinite", result.stderr)
        result = forge("--training.steps", "1", "--logging.run_dir", os.path.join(scratch(self), "r"),
                       env={"FORGE_TEST_INJECT_NAN": "two:embedding.weight"})
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("FORGE_TEST_INJECT_NAN", result.stderr)


class LossSpikes(unittest.TestCase):
    """NOTE [Loss spikes]: FORGE_TEST_SCALE_LOSS multiplies chosen steps' global loss (not
    their gradients); with a window of 3 detection starts at step 4."""
    SPIKE = ["--training.loss_spike_factor", "2", "--training.loss_spike_window", "3", *TINY]

    def run_with(self, action, steps=6, scale="5:4", ranks=1, run_dir=None, extra=()):
        run_dir = run_dir or os.path.join(scratch(self), "run")
        result = forge("--training.steps", str(steps), "--logging.run_dir", run_dir, "--training.on_loss_spike",
                       action, *self.SPIKE, *extra, env={"FORGE_TEST_SCALE_LOSS": scale}, ranks=ranks)
        return run_dir, result

    def skip_run(self, ranks):
        run_dir, result = self.run_with("skip", ranks=ranks, extra=["--checkpoint.enable", "true",
                                                                    "--checkpoint.interval", "1"])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("loss spike at step 5", result.stderr)
        self.assertIn("training.on_loss_spike skip", result.stderr)
        self.assertIn("loss spikes: 1 at step 5", result.stdout + result.stderr)
        steps = records(run_dir)
        mean = (steps[1]["loss"] + steps[2]["loss"] + steps[3]["loss"]) / 3
        self.assertTrue(steps[4]["skipped"])
        self.assertTrue(steps[4]["loss_spike"])
        self.assertEqual(steps[4]["loss_spike_mean"], mean)
        self.assertEqual((steps[4]["loss_spikes"], steps[4]["skipped_steps"]), (1, 1))
        self.assertFalse(any(r.get("loss_spike") for r in steps[:4] + steps[5:]))
        # Weights, both moments and AdamW's step count: bitwise those of step 4.
        before, after = checkpoint_state(run_dir, 4), checkpoint_state(run_dir, 5)
        self.assertEqual(before[1], after[1])
        self.assertEqual(before[0], after[0])
        self.assertNotEqual(checkpoint_state(run_dir, 6)[0], after[0])

    def test_skip_leaves_weights_and_optimizer_state_bitwise(self):
        self.skip_run(1)

    def test_skip_on_two_ranks(self):
        self.skip_run(2)

    def test_warn_applies_the_update_and_counts(self):
        run_dir, result = self.run_with("warn")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("loss spike at step 5", result.stderr)
        self.assertIn("the step's update is applied", result.stderr)
        steps = records(run_dir)
        self.assertTrue(steps[4]["loss_spike"])
        self.assertNotIn("skipped", steps[4])
        self.assertEqual(steps[5]["loss_spikes"], 1)

    def test_stop_names_step_loss_and_mean(self):
        run_dir, result = self.run_with("stop")
        self.assertEqual(result.returncode, 1, result.stderr)
        steps = records(run_dir)
        self.assertEqual([r["step"] for r in steps], [1, 2, 3, 4])
        mean = (steps[1]["loss"] + steps[2]["loss"] + steps[3]["loss"]) / 3
        self.assertIn("loss spike at step 5: loss ", result.stderr)
        self.assertIn(f"running mean {mean!r} of the last 3", result.stderr)
        self.assertIn("training.on_loss_spike stop", result.stderr)

    def test_no_detection_while_the_window_fills(self):
        run_dir, result = self.run_with("stop", steps=4, scale="3:100")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertFalse(any(r.get("loss_spike") for r in records(run_dir)))

    def test_resume_decides_as_the_uninterrupted_run(self):
        # Spikes at 4 (before the checkpoint) and 6: at 6 the mean needs the saved window.
        scale = "4:4,6:4"
        whole, result = self.run_with("skip", steps=8, scale=scale)
        self.assertEqual(result.returncode, 0, result.stderr)
        run_dir = os.path.join(scratch(self), "run")
        ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
        for steps in (4, 8):
            _, result = self.run_with("skip", steps=steps, scale=scale, run_dir=run_dir, extra=ckpt)
            self.assertEqual(result.returncode, 0, result.stderr)
        with open(os.path.join(run_dir, "checkpoints", "step-4", "metadata.json")) as f:
            self.assertEqual(len(json.load(f)["loss_spike"]["recent_losses"]), 3)

        def decisions(folder):
            latest = {r["step"]: r for r in records(folder)}
            return [(s, latest[s]["loss"], latest[s].get("loss_spike"), latest[s].get("loss_spike_mean"))
                    for s in sorted(latest)]
        self.assertEqual([d[0] for d in decisions(whole) if d[2]], [4, 6])
        self.assertEqual(decisions(run_dir), decisions(whole))

    def test_bad_settings_name_the_key(self):
        for key, value in (("training.loss_spike_factor", "0.5"), ("training.loss_spike_window", "0"),
                           ("training.on_loss_spike", "ignore")):
            result = forge(f"--{key}", value)
            self.assertNotEqual(result.returncode, 0)
            self.assertIn(key, result.stderr)


# Enough steps (about 10 ms each on an idle core) that a signal sent after step 2 lands mid-run.
SLOW = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--eval.interval", "0",
        "--logging.log_interval", "1", "--lr_scheduler.warmup_steps", "2"]
STEPS = 30


class Signals(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.reference_dir = scratch_dir()
        cls.addClassCleanup(shutil.rmtree, cls.reference_dir, ignore_errors=True)
        result = forge("--training.steps", str(STEPS), "--logging.run_dir", cls.reference_dir, *SLOW)
        assert result.returncode == 0, result.stderr
        cls.reference = train_losses(cls.reference_dir)

    def start(self, run_dir, ranks=1):
        args = ["train", "--training.steps", str(STEPS), "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                "--checkpoint.interval", "1000", *SLOW]
        if ranks > 1:
            args = ["launch", "--nproc-per-node", str(ranks), "--grace-period", "60", "--", args[0],
                    "--parallelism.data_parallel_shard_degree", str(ranks), *args[1:]]
        return [forge_bin(), *args]

    @staticmethod
    def wait_for_step(run_dir, step, proc):
        deadline = time.time() + TIMEOUT
        path = os.path.join(run_dir, "metrics.jsonl")
        while time.time() < deadline and proc.poll() is None:
            try:
                if os.path.exists(path) and len(records(run_dir)) >= step:
                    return
            except ValueError:  # a line being written
                pass
            time.sleep(0.02)
        raise AssertionError(f"step {step} never came")

    def stop_and_resume(self, deliver, ranks=1):
        run_dir = os.path.join(scratch(self), "run")
        command = self.start(run_dir, ranks)
        env = dict(os.environ, FORGE_NUM_THREADS="1")
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.wait_for_step(run_dir, 2, proc)
        deliver(proc)
        out, err = proc.communicate(timeout=TIMEOUT)
        self.assertEqual(proc.returncode, EXIT_STOPPED, err)
        stopped_at = [r["step"] for r in records(run_dir)][-1]
        self.assertLess(stopped_at, STEPS)
        self.assertIn(f"after step {stopped_at}, checkpoint saved", err)
        self.assertEqual(sorted(os.listdir(os.path.join(run_dir, "checkpoints"))), [f"step-{stopped_at}"])
        resumed = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        self.assertEqual(resumed.returncode, 0, resumed.stderr)
        self.assertIn(f"step-{stopped_at}", resumed.stdout)
        return run_dir, err

    def test_sigterm_saves_and_the_same_command_resumes_bitwise(self):
        run_dir, err = self.stop_and_resume(lambda p: p.send_signal(signal.SIGTERM))
        self.assertIn("stopped by SIGTERM", err)
        self.assertEqual(train_losses(run_dir), self.reference)

    def test_sigint_twice_aborts_at_once(self):
        run_dir = os.path.join(scratch(self), "run")
        proc = subprocess.Popen(self.start(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.wait_for_step(run_dir, 1, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=TIMEOUT)
        # Killed by the second SIGINT, unless the first one's stop (one step and a save) won the race.
        self.assertIn(proc.returncode, (-signal.SIGINT, EXIT_STOPPED))
        if proc.returncode == -signal.SIGINT:
            self.assertFalse(os.path.isdir(os.path.join(run_dir, "checkpoints")) and
                             any(n.startswith("step-") for n in os.listdir(os.path.join(run_dir, "checkpoints"))))

    def test_sigterm_to_the_launcher_stops_every_rank_at_one_step(self):
        run_dir, _ = self.stop_and_resume(lambda p: p.send_signal(signal.SIGTERM), ranks=2)
        self.assertEqual(sorted({r["step"] for r in records(run_dir)}), list(range(1, STEPS + 1)))

    def test_sigterm_to_one_rank_stops_both_at_the_same_step(self):
        def signal_rank_one(launcher):
            deadline = time.time() + 30
            while time.time() < deadline:
                with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
                    children = f.read().split()
                for pid in children:
                    try:
                        with open(f"/proc/{pid}/environ", "rb") as e:
                            variables = e.read().split(b"\0")
                    except OSError:
                        continue
                    if b"RANK=1" in variables:
                        os.kill(int(pid), signal.SIGTERM)
                        return
                time.sleep(0.05)
            raise AssertionError("rank 1 not found")

        self.stop_and_resume(signal_rank_one, ranks=2)


class Requeue(unittest.TestCase):
    def test_attempt_that_died_before_its_first_checkpoint_starts_afresh(self):
        run_dir = os.path.join(scratch(self), "run")
        reference = os.path.join(scratch(self), "reference")
        self.assertEqual(forge("--training.steps", "4", "--logging.run_dir", reference, *TINY).returncode, 0)
        # The first attempt wrote metrics.jsonl and died before its first checkpoint.
        first = forge("--training.steps", "2", "--logging.run_dir", run_dir, *TINY)
        self.assertEqual(first.returncode, 0, first.stderr)
        again = forge("--training.steps", "4", "--logging.run_dir", run_dir, "--checkpoint.enable", "true", *TINY)
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertIn("starting the run afresh from step 0", again.stderr)
        self.assertEqual(train_losses(run_dir), train_losses(reference))

    def test_finished_run_with_hf_export_started_again(self):
        run_dir = os.path.join(scratch(self), "run")
        args = ["--training.steps", "3", "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                "--checkpoint.last_save_in_hf", "true", *TINY]
        self.assertEqual(forge(*args).returncode, 0)
        exported = sorted(os.listdir(os.path.join(run_dir, "hf")))
        again = forge(*args)
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertIn("nothing left to train", again.stdout)
        self.assertIn("is already there", again.stdout)
        self.assertEqual(sorted(os.listdir(os.path.join(run_dir, "hf"))), exported)


if __name__ == "__main__":
    unittest.main()
