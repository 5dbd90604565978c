"""Failure detection and restarts across real processes on the CPU (forge launch, the CPU
process group, NOTE [Failure detection]): a rank SIGKILLed mid-step in a 4-rank job makes
every rank exit within 30 s naming it and its step, a stopped one (SIGSTOP) after
parallelism.heartbeat_timeout_s; a rank stuck outside any collective is
reported with the collective the others wait in, its sequence number and every rank's
flight record; with --max-restarts 1 the killed job finishes and its losses are bitwise
those of the uninterrupted run; and each rank reading only its own micro-batches keeps
the losses bitwise those forge computed when every rank read the whole global batch.

Ranks are stopped at a chosen step through the test hook FORGE_DEBUG_HANG_AT=RANK:STEP
(the rank sleeps at the start of that step and prints its pid); the kill is a real
SIGKILL from here. Waits are generous (loaded CI machines), the checks on what the ranks
print strict."""
import json
import os
import re
import signal
import subprocess
import threading
import time
import unittest

from forge_test_util import forge_bin, scratch_dir

RANKS = 4
STEPS = 8
WAIT = 240  # for things that happen in seconds on an idle machine

# Losses of debug-tiny, 6 steps, micro-batch 2, global batch 8, recorded with forge before
# ranks read only their own micro-batches (every rank then read the whole global batch).
RECORDED = {
    (2, 1): [3.486762523651123, 3.462493419647217, 3.4167675971984863, 3.357666492462158, 3.300584077835083,
             3.2387068271636963],
    (4, 1): [3.486762523651123, 3.462493419647217, 3.4167678356170654, 3.3576667308807373, 3.300584077835083,
             3.2387068271636963],
    (2, 2): [3.486762285232544, 3.462493419647217, 3.4167675971984863, 3.3576667308807373, 3.300584077835083,
             3.238706588745117],
}


def train_args(run_dir, steps=STEPS, shard=RANKS, replicate=1, *overrides):
    accum = 8 // (2 * shard * replicate)
    return ["train", "--training.steps", str(steps), "--training.local_batch_size", "2",
            "--training.gradient_accumulation_steps", str(accum), "--eval.interval", "0",
            "--logging.run_dir", run_dir, "--parallelism.data_parallel_shard_degree", str(shard),
            "--parallelism.data_parallel_replicate_degree", str(replicate), *overrides]


def environment(**extra):
    env = {name: value for name, value in os.environ.items() if name != "FORGE_DEBUG_HANG_AT"}
    env.update(FORGE_NUM_THREADS="1", **extra)
    return env


def losses_by_step(run_dir):
    """The loss of every step; a step run again after a restart counts as its last record."""
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for record in map(json.loads, f):
            if record.get("type") == "train":
                by_step[record["step"]] = record["loss"]
    return [by_step[s] for s in sorted(by_step)]


class Job:
    """forge launch in the background, its stderr read line by line as it comes."""

    def __init__(self, launch_args, args, **env):
        self.proc = subprocess.Popen([forge_bin(), "launch", "--nproc-per-node", str(RANKS), *launch_args, "--",
                                      *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=environment(**env))
        self.lines = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, pattern):
        deadline = time.monotonic() + WAIT
        with self.changed:
            while True:
                for line in self.lines:
                    match = re.search(pattern, line)
                    if match:
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not self.reader.is_alive():
                    self.proc.kill()
                    raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-60:]))
                self.changed.wait(min(left, 1))

    def finish(self):
        try:
            code = self.proc.wait(timeout=WAIT)
        finally:
            self.proc.kill()
        self.reader.join(timeout=30)
        self.proc.stderr.close()
        return code, "\n".join(self.lines)

    def kill_rank_when_it_hangs(self, rank):
        """SIGKILLs `rank` once it sleeps in its FORGE_DEBUG_HANG_AT step; returns the time."""
        pid = int(self.wait_for(rf"^\[rank {rank}\] .*FORGE_DEBUG_HANG_AT: rank {rank} \(pid (\d+)\)").group(1))
        os.kill(pid, signal.SIGKILL)
        return time.monotonic()


def rank_lines(text, rank):
    return [line for line in text.splitlines() if line.startswith(f"[rank {rank}] ")]


class FailureDetection(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    def test_a_killed_rank_is_named_by_every_rank_within_30_s(self):
        run_dir = os.path.join(self.tmp, "killed")
        job = Job([], train_args(run_dir), FORGE_DEBUG_HANG_AT="2:5")
        killed_at = job.kill_rank_when_it_hangs(2)
        code, text = job.finish()
        self.assertLess(time.monotonic() - killed_at, 30, text[-3000:])
        self.assertEqual(code, 128 + signal.SIGKILL, text[-3000:])
        self.assertIn("forge launch: rank 2 was killed by signal 9 (SIGKILL)", text)
        for rank in (0, 1, 3):
            stops = [line for line in rank_lines(text, rank) if f"rank {rank} of 4 stops" in line]
            self.assertTrue(stops, text[-3000:])
            self.assertRegex(stops[0], r"rank 2 \(\S+\) is gone: its heartbeat connection closed without a goodbye "
                                       r"in step 5")
        # No rank was left to the launcher's SIGTERM: each noticed on its own.
        self.assertNotIn("stopping them (SIGTERM", text)

    def test_a_stopped_rank_is_named_after_the_heartbeat_timeout(self):
        run_dir = os.path.join(self.tmp, "stopped")
        job = Job(["--grace-period", "1"], train_args(run_dir, STEPS, RANKS, 1, "--parallelism.heartbeat_timeout_s", "4"),
                  FORGE_DEBUG_HANG_AT="2:4")
        pid = int(job.wait_for(r"^\[rank 2\] .*FORGE_DEBUG_HANG_AT: rank 2 \(pid (\d+)\)").group(1))
        os.kill(pid, signal.SIGSTOP)  # its heartbeat thread stops too
        try:
            code, text = job.finish()
        finally:
            try:
                os.kill(pid, signal.SIGKILL)  # the launcher has; never leave a stopped process behind
            except ProcessLookupError:
                pass
        self.assertNotEqual(code, 0)
        for rank in (0, 1, 3):
            stops = [line for line in rank_lines(text, rank) if f"rank {rank} of 4 stops" in line]
            self.assertTrue(stops, text[-3000:])
            self.assertRegex(stops[0], r"rank 2 \(\S+\) sent no heartbeat for 4 s \(parallelism.heartbeat_timeout_s\), "
                                       r"last in step 4")

    def test_a_hung_rank_is_reported_with_the_collective_and_its_sequence_number(self):
        run_dir = os.path.join(self.tmp, "hung")
        job = Job([], train_args(run_dir, 6, RANKS, 1, "--parallelism.nccl_timeout_s", "3"),
                  FORGE_DEBUG_HANG_AT="2:3")
        job.wait_for(r"^\[rank 2\] .*FORGE_DEBUG_HANG_AT: rank 2")
        started = time.monotonic()
        code, text = job.finish()
        self.assertLess(time.monotonic() - started, 30, text[-3000:])
        self.assertNotEqual(code, 0)
        verdict = re.search(r"^\[rank 0\] .*rank 0 of 4 stops in step 3: rank 0 of 4: "
                            r"((all_reduce|all_gather|reduce_scatter) #(\d+)) [^:]* on the world: rank 2 did not "
                            r"arrive within 3 s \(3 of 4 ranks did\)", text, re.M)
        self.assertIsNotNone(verdict, text[-4000:])
        collective, number = verdict.group(1), int(verdict.group(3))
        # Every rank printed its flight record: the others are in that collective, rank 2
        # finished the one before it and never started it.
        for rank in range(RANKS):
            lines = rank_lines(text, rank)
            self.assertTrue(any(f"rank {rank} of 4 stops" in line for line in lines), text[-4000:])
            self.assertTrue(any(f"flight record of rank {rank}:" in line for line in lines), text[-4000:])
            record = [line for line in lines if re.search(r"#\d+ .* on the world: started", line)]
            self.assertTrue(record, text[-4000:])
            if rank == 2:
                self.assertRegex(record[-1], rf"#{number - 1} .* took ")
                self.assertFalse(any(f"{collective} " in line for line in record), record)
            else:
                self.assertRegex(record[-1], rf"{collective} .* still running after")
        self.assertTrue(any(f"rank 2 of 4 stops in step 3" in line for line in rank_lines(text, 2)), text[-4000:])
        # Rank 0 blamed rank 2: the others exit 76 (stopped because another failed), so
        # the launcher names rank 2.
        self.assertIn("forge launch: rank 2 exited with code 1", text)
        self.assertEqual(code, 1)

    def test_restart_after_a_kill_reproduces_the_uninterrupted_losses(self):
        reference = os.path.join(self.tmp, "reference")
        args = ("--checkpoint.enable", "true", "--checkpoint.interval", "2")
        code, text = Job([], train_args(reference, STEPS, RANKS, 1, *args)).finish()
        self.assertEqual(code, 0, text[-3000:])

        run_dir = os.path.join(self.tmp, "restarted")
        job = Job(["--max-restarts", "1"], train_args(run_dir, STEPS, RANKS, 1, *args), FORGE_DEBUG_HANG_AT="2:5")
        job.kill_rank_when_it_hangs(2)
        code, text = job.finish()
        self.assertEqual(code, 0, text[-4000:])
        self.assertIn("forge launch: restart 1 of 1 after rank 2 was killed by signal 9 (SIGKILL)", text)
        with open(os.path.join(run_dir, "restarts.log")) as f:
            log = f.read().splitlines()
        self.assertEqual(len(log), 1, log)
        self.assertRegex(log[0], r"^\S+Z restart 1 of 1 after rank 2 was killed by signal 9 \(SIGKILL\); resuming "
                                 r"from \S+/step-[24]$")
        self.assertEqual(losses_by_step(run_dir), losses_by_step(reference))

    def test_a_stop_on_request_is_not_restarted_and_restarts_run_out(self):
        # A rank that fails every time: one restart, then the launcher gives up.
        result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", "2", "--max-restarts", "1", "--", "sh",
                                 "-c", 'echo "attempt $FORGE_RESTART_COUNT"; [ "$RANK" = 0 ] && exit 3; exit 0'],
                                capture_output=True, text=True,
                                timeout=WAIT)
        self.assertEqual(result.returncode, 3, result.stderr)
        self.assertIn("forge launch: restart 1 of 1 after rank 0 exited with code 3", result.stderr)
        self.assertIn("forge launch: rank 0 exited with code 3 after 1 restart: giving up", result.stderr)
        self.assertEqual(result.stdout.count("[rank 0] attempt 0"), 1, result.stdout)
        self.assertEqual(result.stdout.count("[rank 0] attempt 1"), 1, result.stdout)
        # Exit status 75 (kExitStoppedBySignal, core/exit_status.h) is a stop on request.
        result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", "2", "--max-restarts", "3", "--", "sh",
                                 "-c", 'echo "attempt $FORGE_RESTART_COUNT"; exit 75'], capture_output=True,
                                text=True, timeout=WAIT)
        self.assertEqual(result.returncode, 75, result.stderr)
        self.assertNotIn("restart", result.stderr)
        self.assertNotIn("attempt 1", result.stdout)
        result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", "1", "--max-restarts", "-1", "--", "true"],
                                capture_output=True, text=True, timeout=WAIT)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--max-restarts", result.stderr)


class OwnMicroBatches(unittest.TestCase):
    def test_losses_are_bitwise_those_of_reading_the_whole_global_batch(self):
        tmp = scratch_dir()
        for (shard, replicate), expected in RECORDED.items():
            with self.subTest(shard=shard, replicate=replicate):
                run_dir = os.path.join(tmp, f"{shard}x{replicate}")
                ranks = shard * replicate
                result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", str(ranks), "--",
                                         *train_args(run_dir, 6, shard, replicate)], capture_output=True, text=True,
                                        timeout=WAIT, env=environment())
                self.assertEqual(result.returncode, 0, result.stderr[-3000:])
                self.assertEqual(losses_by_step(run_dir), expected)


if __name__ == "__main__":
    unittest.main()
