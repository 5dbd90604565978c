"""Checkpoints and resume of FLUX runs (NOTE [FLUX checkpoints], NOTE [Exact FLUX resume]):
flux-debug on the CPU, stopped (a shorter run, SIGTERM, SIGKILL at random instants) and
started again with the same command, ends with the uninterrupted run's losses and, bit for
bit, its final master weights and AdamW moments; keep_latest_k; asynchronous saves and the
buffer size change no byte; checkpoint.initial_load_path starts from a checkpoint's weights;
a damaged newest checkpoint is passed over for the one before; another block count, a
language model's checkpoint (and a FLUX checkpoint offered to a language model) and
damaged files are refused naming the file."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
import unittest

from forge_test_util import forge_bin, scratch_dir, source_dir

STEPS = 8
TIMEOUT = 300
ENV = dict(os.environ, FORGE_NUM_THREADS="1")
# The LR schedule (2 warmup steps, then constant) does not depend on training.steps, so a
# shorter run is the longer one stopped early.
ARGS = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--logging.log_interval", "1"]


def experiment():
    return os.path.join(source_dir(), "configs", "experiments", "cpu", "flux-debug.yaml")


def train(run_dir, *extra, steps=STEPS):
    return subprocess.run([forge_bin(), "train", experiment(), "--training.steps", str(steps), "--logging.run_dir",
                           run_dir, *ARGS, *extra], capture_output=True, text=True, timeout=TIMEOUT, env=ENV)


def losses(result):
    """{step: loss} of the step lines a run logged."""
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+) \| loss ([0-9.]+)", result.stdout + result.stderr)}


def steps_in(folder):
    return sorted(int(n[5:]) for n in os.listdir(folder) if n.startswith("step-"))


def state_bytes(run_dir, step=STEPS):
    """The checkpoint's master weights, m and v, as bytes."""
    with open(os.path.join(run_dir, "checkpoints", f"step-{step}", "rank-0.bin"), "rb") as f:
        return f.read()


def first_piece(step_dir, name, state):
    with open(os.path.join(step_dir, "metadata.json")) as f:
        return next(t for t in json.load(f)["tensors"] if t["name"] == name and t["state"] == state)["pieces"][0]


def flip_byte(step_dir, name="x_embedder.weight", state="exp_avg"):
    piece = first_piece(step_dir, name, state)
    with open(os.path.join(step_dir, "rank-0.bin"), "r+b") as f:
        f.seek(piece["byte_offset"])
        byte = f.read(1)[0]
        f.seek(piece["byte_offset"])
        f.write(bytes([byte ^ 0x01]))


class FluxResume(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = scratch_dir()
        cls.addClassCleanup(shutil.rmtree, cls.dir, ignore_errors=True)
        cls.full = os.path.join(cls.dir, "full")
        result = train(cls.full)
        assert result.returncode == 0, result.stderr
        cls.full_losses = losses(result)
        assert sorted(cls.full_losses) == list(range(1, STEPS + 1)), result.stdout
        cls.full_state = state_bytes(cls.full)

    def run_dir(self):
        path = os.path.join(self.dir, self._testMethodName)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def test_checkpoints_at_the_interval_and_the_end(self):
        self.assertEqual(steps_in(os.path.join(self.full, "checkpoints")), [2, 4, 6, 8])
        with open(os.path.join(self.full, "checkpoints", "step-6", "metadata.json")) as f:
            md = json.load(f)
        self.assertEqual(md["flux_model"]["name"], "flux-debug")
        self.assertNotIn("model", md)
        self.assertEqual(md["step"], 6)
        self.assertEqual(md["data"]["position"], 6)
        self.assertEqual(md["optimizer"]["step"], 6)
        self.assertIn("flux-debug", md["experiment_config"])

    def test_stop_and_resume_is_bitwise_the_uninterrupted_run(self):
        run_dir = self.run_dir()
        first = train(run_dir, steps=5)  # saves steps 2, 4 and its last, 5
        self.assertEqual(first.returncode, 0, first.stderr)
        self.assertEqual(steps_in(os.path.join(run_dir, "checkpoints")), [2, 4, 5])
        second = train(run_dir)
        self.assertEqual(second.returncode, 0, second.stderr)
        self.assertIn("resuming from checkpoint", second.stdout)
        self.assertIn("step-5", second.stdout)
        got = {**losses(first), **losses(second)}
        self.assertEqual(sorted(losses(second)), [6, 7, 8])
        self.assertEqual(got, self.full_losses)
        self.assertEqual(state_bytes(run_dir), self.full_state)
        # A finished run started again has nothing to train.
        again = train(run_dir)
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertEqual(losses(again), {})
        self.assertEqual(state_bytes(run_dir), self.full_state)

    def test_sigterm_saves_and_exits_75_then_resumes(self):
        run_dir = self.run_dir()
        proc = subprocess.Popen([forge_bin(), "train", experiment(), "--training.steps", "400", "--logging.run_dir",
                                 run_dir, *ARGS, "--checkpoint.interval", "1000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for line in proc.stdout:
            if re.search(r"step +2 \|", line):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
        self.assertEqual(proc.returncode, 75, err)
        stopped = steps_in(os.path.join(run_dir, "checkpoints"))
        self.assertEqual(len(stopped), 1, out)
        self.assertGreaterEqual(stopped[0], 2)
        self.assertLess(stopped[0], 400)

    def test_sigkill_at_random_instants(self):
        """A 30-step run saving every step (a save takes longer than a step, so the instants
        land in both), killed 8 times and started again with the same command each time."""
        rng = random.Random(2222)
        command = [forge_bin(), "train", experiment(), "--training.steps", "30", *ARGS, "--checkpoint.interval", "1",
                   "--checkpoint.keep_latest_k", "2"]
        reference = os.path.join(self.run_dir(), "reference")
        result = subprocess.run([*command, "--logging.run_dir", reference], capture_output=True, text=True,
                                timeout=TIMEOUT, env=ENV)
        self.assertEqual(result.returncode, 0, result.stderr)
        run_dir = os.path.join(self.dir, self._testMethodName, "killed")
        kills, in_save = 0, 0
        while True:
            proc = subprocess.Popen([*command, "--logging.run_dir", run_dir], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=ENV)
            if kills < 8:
                time.sleep(rng.uniform(0.1, 1.5))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    kills += 1
            out, err = proc.communicate(timeout=TIMEOUT)
            self.assertNotIn("cannot be resumed from", err)
            folder = os.path.join(run_dir, "checkpoints")
            if proc.returncode == -signal.SIGKILL:
                if os.path.isdir(folder) and any(n.startswith(".tmp-") for n in os.listdir(folder)):
                    in_save += 1
                continue
            self.assertEqual(proc.returncode, 0, err)
            break
        print(f"{kills} kills, {in_save} of them during a save")
        self.assertEqual(state_bytes(run_dir, 30), state_bytes(reference, 30))
        self.assertEqual(steps_in(os.path.join(run_dir, "checkpoints")), [29, 30])

    def test_keep_latest_k(self):
        run_dir = self.run_dir()
        result = train(run_dir, "--checkpoint.keep_latest_k", "2")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(steps_in(os.path.join(run_dir, "checkpoints")), [6, 8])
        self.assertEqual(state_bytes(run_dir), self.full_state)

    def test_async_saves_and_a_small_buffer_change_no_byte(self):
        for extra in (["--checkpoint.async_mode", "async"], ["--checkpoint.buffer_mb", "1"]):
            with self.subTest(extra):
                run_dir = self.run_dir()
                result = train(run_dir, *extra)
                self.assertEqual(result.returncode, 0, result.stderr)
                for step in (2, 4, 6, 8):
                    self.assertEqual(state_bytes(run_dir, step), state_bytes(self.full, step))
                if "async" in extra:
                    self.assertIn("asynchronous: the step loop waited", result.stdout)
                resumed = train(run_dir, *extra, "--checkpoint.load_step", "4")
                self.assertEqual(resumed.returncode, 0, resumed.stderr)
                self.assertEqual({s: l for s, l in losses(resumed).items()},
                                 {s: self.full_losses[s] for s in range(5, STEPS + 1)})
                self.assertEqual(state_bytes(run_dir), self.full_state)

    def test_initial_load_path_starts_from_the_weights(self):
        run_dir = self.run_dir()
        weights = os.path.join(self.full, "checkpoints")  # a folder of them: the newest
        result = subprocess.run([forge_bin(), "train", experiment(), "--training.steps", "2", "--logging.run_dir",
                                 run_dir, "--checkpoint.initial_load_path", weights],
                                capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"initial FLUX weights from checkpoint '{weights}/step-{STEPS}'", result.stdout)
        started = losses(result)
        self.assertEqual(sorted(started), [1, 2])
        self.assertLess(started[1], self.full_losses[1])

    def test_damaged_newest_is_passed_over(self):
        run_dir = self.run_dir()
        shutil.copytree(self.full, run_dir)
        newest = os.path.join(run_dir, "checkpoints", f"step-{STEPS}")
        flip_byte(newest)
        result = train(run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"checkpoint '{newest}' cannot be resumed from", result.stderr)
        self.assertIn("tensor 'x_embedder.weight' (exp_avg)", result.stderr)
        self.assertIn("step-6", result.stdout)
        self.assertEqual(losses(result), {s: self.full_losses[s] for s in (7, 8)})
        self.assertEqual(state_bytes(run_dir), self.full_state)

    def test_refusals(self):
        base = self.run_dir()
        # A damaged checkpoint asked for by load_step, a truncated one: errors naming the file.
        run_dir = os.path.join(base, "damaged")
        shutil.copytree(self.full, run_dir)
        step6 = os.path.join(run_dir, "checkpoints", "step-6")
        flip_byte(step6, "proj_out.weight", "exp_avg_sq")
        result = train(run_dir, "--checkpoint.load_step", "6")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(os.path.join(step6, "rank-0.bin"), result.stderr)
        self.assertIn("tensor 'proj_out.weight' (exp_avg_sq)", result.stderr)
        shard = os.path.join(run_dir, "checkpoints", "step-4", "rank-0.bin")
        os.truncate(shard, os.path.getsize(shard) - 100)
        result = train(run_dir, "--checkpoint.load_step", "4")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(shard, result.stderr)
        self.assertIn("shorter than", result.stderr)
        # Another block count: refused, not passed over as damage.
        other = os.path.join(base, "other-blocks")
        shutil.copytree(self.full, other)
        result = train(other, "--flux.num_double_blocks", "1")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(os.path.join(other, "checkpoints", f"step-{STEPS}"), result.stderr)
        self.assertIn("1 double + 2 single blocks", result.stderr)
        self.assertNotIn("cannot be resumed from", result.stderr)
        # A language model's checkpoint in a FLUX run's folder, and the reverse.
        lm = os.path.join(base, "lm")
        result = subprocess.run([forge_bin(), "train", "--training.steps", "1", "--logging.run_dir", lm,
                                 "--checkpoint.enable", "true", "--eval.interval", "0"],
                                capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
        self.assertEqual(result.returncode, 0, result.stderr)
        flux_with_lm = os.path.join(base, "flux-with-lm")
        shutil.copytree(os.path.join(lm, "checkpoints"), os.path.join(flux_with_lm, "checkpoints"))
        result = train(flux_with_lm)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(os.path.join(flux_with_lm, "checkpoints", "step-1"), result.stderr)
        self.assertIn("holds a language model", result.stderr)
        result = subprocess.run([forge_bin(), "train", "--training.steps", "1", "--logging.run_dir",
                                 os.path.join(base, "lm-from-flux"), "--eval.interval", "0",
                                 "--checkpoint.initial_load_path", os.path.join(self.full, "checkpoints", "step-2")],
                                capture_output=True, text=True, timeout=TIMEOUT, env=ENV)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("holds a FLUX transformer ('flux-debug'", result.stderr)
        # Keys a FLUX run does not take together or at all.
        for extra, fragment in ((["--checkpoint.initial_load_path", os.path.join(self.full, "checkpoints"), "--flux.initial_load_path",
                                  self.full],
                                 "starts from one of them"),
                                (["--checkpoint.last_save_in_hf", "true"], "flux.last_save_in_diffusers"),
                                (["--checkpoint.initial_load_path", experiment()], "not a directory")):
            with self.subTest(extra):
                result = train(os.path.join(base, "keys"), *extra)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(fragment, result.stderr)


if __name__ == "__main__":
    unittest.main()
