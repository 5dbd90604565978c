"""Kill tests: forge train killed (SIGKILL) at seeded random instants, during steps and
during checkpoint saves, and started again with the same command each time, ends with
bitwise the losses of the uninterrupted run (one process, and two ranks under forge launch
with one rank killed); a damaged newest checkpoint (a flipped byte, a truncated shard, a
step that disagrees with its directory name) is reported by file and the previous one is
used (NOTE [Choosing the checkpoint to resume])."""
import json
import os
import random
import shutil
import signal
import subprocess
import time
import unittest

from forge_test_util import forge_bin, scratch_dir, train_losses

# Saving a checkpoint (3.5 MB, fsynced) takes about as long as a step, so the random
# instants land in both.
MODEL = ["--model.hidden_size", "128", "--model.ffn_hidden_size", "512", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--eval.interval", "0", "--logging.log_interval", "1",
         "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "8"]
STEPS = 10
KILLS = 20
RANK_KILLS = 6
SEED = 1818
TIMEOUT = 120
ENV = dict(os.environ, FORGE_NUM_THREADS="1")


def train_command(run_dir, ranks=1, steps=STEPS):
    args = ["train", "--training.steps", str(steps), "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
            "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2", *MODEL]
    if ranks > 1:
        return [forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", args[0],
                "--parallelism.data_parallel_shard_degree", str(ranks), *args[1:]]
    return [forge_bin(), *args]


def rank_pids(launcher):
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
        return [int(pid) for pid in f.read().split()]


class Kills(unittest.TestCase):
    def setUp(self):
        self.dir = scratch_dir()
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.rng = random.Random(SEED)

    def reference(self, ranks):
        run_dir = os.path.join(self.dir, f"reference-{ranks}")
        result = subprocess.run(train_command(run_dir, ranks), capture_output=True, text=True, timeout=TIMEOUT,
                                env=ENV)
        self.assertEqual(result.returncode, 0, result.stderr)
        return train_losses(run_dir)

    def kill_and_resume(self, ranks, kills, kill):
        """Rounds of one run each: started, killed after a random delay, started again with
        the same command, ... until it finishes; then its losses must be the reference's."""
        reference = self.reference(ranks)
        done, rounds, in_save = 0, 0, 0
        while done < kills:
            run_dir = os.path.join(self.dir, f"run-{ranks}-{rounds}")
            rounds += 1
            while True:
                proc = subprocess.Popen(train_command(run_dir, ranks), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=ENV)
                killed = False
                if done < kills:
                    time.sleep(self.rng.uniform(0.05, 1.2))
                    if proc.poll() is None:
                        kill(proc)
                        killed = True
                        done += 1
                out, err = proc.communicate(timeout=TIMEOUT)
                self.assertNotIn("cannot be resumed from", err)
                folder = os.path.join(run_dir, "checkpoints")
                if killed and os.path.isdir(folder) and any(n.startswith(".tmp-") for n in os.listdir(folder)):
                    in_save += 1
                if not killed:
                    self.assertEqual(proc.returncode, 0, err)
                    break
            self.assertEqual(train_losses(run_dir), reference, f"round {rounds}")
            shutil.rmtree(run_dir)
        print(f"{done} kills in {rounds} runs, {in_save} of them during a save")

    def test_sigkill_one_process(self):
        self.kill_and_resume(1, KILLS, lambda proc: proc.send_signal(signal.SIGKILL))

    def test_sigkill_one_rank_of_two(self):
        def kill_a_rank(launcher):
            pids = rank_pids(launcher)
            if pids:
                os.kill(self.rng.choice(pids), signal.SIGKILL)
            else:
                launcher.send_signal(signal.SIGTERM)
        self.kill_and_resume(2, RANK_KILLS, kill_a_rank)


class DamagedNewest(unittest.TestCase):
    """Checkpoints at steps 3 and 6 of a 6-step run; the newest is damaged, and the same
    run resumed with 6 steps goes back to step 3 and ends with the uninterrupted losses."""

    @classmethod
    def setUpClass(cls):
        cls.dir = scratch_dir()
        cls.addClassCleanup(shutil.rmtree, cls.dir, ignore_errors=True)
        cls.full = os.path.join(cls.dir, "full")
        result = subprocess.run(cls.command(cls.full), capture_output=True, text=True, env=ENV, timeout=TIMEOUT)
        assert result.returncode == 0, result.stderr
        cls.full_losses = train_losses(cls.full)

    @staticmethod
    def command(run_dir):
        return [forge_bin(), "train", "--training.steps", "6", "--logging.run_dir", run_dir, "--checkpoint.enable",
                "true", "--checkpoint.interval", "3", *MODEL]

    def damaged_copy(self, damage):
        run_dir = os.path.join(self.dir, f"run-{self._testMethodName}")
        shutil.copytree(self.full, run_dir)
        newest = os.path.join(run_dir, "checkpoints", "step-6")
        damage(newest)
        result = subprocess.run(self.command(run_dir), capture_output=True, text=True, env=ENV, timeout=TIMEOUT)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(f"checkpoint '{newest}' cannot be resumed from", result.stderr)
        self.assertIn(f"resuming from checkpoint '{os.path.join(run_dir, 'checkpoints', 'step-3')}'", result.stdout)
        self.assertEqual(train_losses(run_dir), self.full_losses)
        # The run saved step 6 again, whole: it resumes from there now.
        again = subprocess.run(self.command(run_dir), capture_output=True, text=True, env=ENV, timeout=TIMEOUT)
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertIn("step-6", again.stdout)
        self.assertNotIn("cannot be resumed from", again.stderr)
        return result.stderr

    def test_flipped_byte(self):
        def flip(step_dir):
            with open(os.path.join(step_dir, "metadata.json")) as f:
                piece = next(t for t in json.load(f)["tensors"]
                             if t["name"] == "layers.0.mlp.down.weight" and t["state"] == "exp_avg")["pieces"][0]
            with open(os.path.join(step_dir, "rank-0.bin"), "r+b") as f:
                f.seek(piece["byte_offset"] + 7)
                byte = f.read(1)[0]
                f.seek(piece["byte_offset"] + 7)
                f.write(bytes([byte ^ 0x10]))
        err = self.damaged_copy(flip)
        self.assertIn("rank-0.bin' is damaged: tensor 'layers.0.mlp.down.weight' (exp_avg)", err)

    def test_truncated_shard(self):
        def truncate(step_dir):
            shard = os.path.join(step_dir, "rank-0.bin")
            os.truncate(shard, os.path.getsize(shard) // 2)
        err = self.damaged_copy(truncate)
        self.assertIn("rank-0.bin' is", err)
        self.assertIn("shorter than", err)

    def test_missing_shard(self):
        err = self.damaged_copy(lambda step_dir: os.remove(os.path.join(step_dir, "rank-0.bin")))
        self.assertIn("lacks its shard file", err)

    def test_unreadable_metadata(self):
        def garble(step_dir):
            with open(os.path.join(step_dir, "metadata.json"), "w") as f:
                f.write("{\"format\": ")
        err = self.damaged_copy(garble)
        self.assertIn("metadata.json", err)

    def test_step_that_disagrees_with_the_directory_name(self):
        def renumber(step_dir):
            path = os.path.join(step_dir, "metadata.json")
            with open(path) as f:
                metadata = json.load(f)
            metadata["step"] = 5
            with open(path, "w") as f:
                json.dump(metadata, f)
        err = self.damaged_copy(renumber)
        self.assertIn("metadata.json says step 5, its directory name says step 6", err)


if __name__ == "__main__":
    unittest.main()
