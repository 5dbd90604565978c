"""forge launch end to end, with shell scripts as ranks: the torchrun variables each rank
sees, output prefixed per line, a forge subcommand run as this binary, a failing rank
stopping its peers (with the rank, the code or signal, and the launcher's exit code), the
launcher's own SIGTERM / SIGINT reaching every rank (and the programs ranks started), a
rank that ignores SIGTERM killed after the grace period, and the TCP rendezvous across
real processes, including a rank that never comes."""
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import unittest

from forge_test_util import forge_bin, tool

# Every test finishes in seconds; this only keeps a broken launcher from hanging CI.
TIMEOUT = 60


def launch(*args, nproc=2):
    return subprocess.run([forge_bin(), "launch", "--nproc-per-node", str(nproc), *args], capture_output=True,
                          text=True, timeout=TIMEOUT)


def rank_lines(text, rank):
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it only waits for its parent to collect it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Environment(unittest.TestCase):
    def test_each_rank_sees_torchrun_variables(self):
        script = ('echo "RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE '
                  'GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT '
                  'FORGE_LAUNCHED=$FORGE_LAUNCHED"')
        result = launch("--nnodes", "2", "--node-rank", "1", "--master-addr", "node0.example", "--master-port",
                        "4321", "--", "sh", "-c", script, nproc=3)
        self.assertEqual(result.returncode, 0, result.stderr)
        for local in range(3):
            rank = 3 + local
            self.assertEqual(rank_lines(result.stdout, rank),
                             [f"RANK={rank} LOCAL_RANK={local} WORLD_SIZE=6 LOCAL_WORLD_SIZE=3 GROUP_RANK=1 "
                              "MASTER_ADDR=node0.example MASTER_PORT=4321 FORGE_LAUNCHED=1"])

    def test_one_node_defaults_to_localhost_and_a_free_port(self):
        result = launch("--", "sh", "-c", 'echo "$MASTER_ADDR $MASTER_PORT $WORLD_SIZE"')
        self.assertEqual(result.returncode, 0, result.stderr)
        (line0,), (line1,) = rank_lines(result.stdout, 0), rank_lines(result.stdout, 1)
        self.assertEqual(line0, line1)
        addr, port, world = line0.split()
        self.assertEqual((addr, world), ("127.0.0.1", "2"))
        self.assertTrue(1 <= int(port) <= 65535)

    def test_outer_launcher_variables_do_not_leak_through(self):
        env = dict(os.environ, RANK="7", WORLD_SIZE="9", MASTER_PORT="1")
        result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", "1", "--", "sh", "-c",
                                 'echo "$RANK $WORLD_SIZE"'], capture_output=True, text=True, env=env,
                                timeout=TIMEOUT)
        self.assertEqual(rank_lines(result.stdout, 0), ["0 1"])


class Output(unittest.TestCase):
    def test_lines_are_whole_and_prefixed_on_their_own_stream(self):
        script = ('printf "first "; sleep 0.2; printf "half\\n"; echo "to stderr" >&2; '
                  'i=0; while [ $i -lt 200 ]; do echo "line $i of rank $RANK"; i=$((i+1)); done; printf "no newline"')
        result = launch("--", "sh", "-c", script, nproc=3)
        self.assertEqual(result.returncode, 0, result.stderr)
        for rank in range(3):
            lines = rank_lines(result.stdout, rank)
            self.assertEqual(lines[0], "first half")
            self.assertEqual(lines[1:201], [f"line {i} of rank {rank}" for i in range(200)])
            self.assertEqual(lines[201], "no newline")
            self.assertEqual(rank_lines(result.stderr, rank), ["to stderr"])
        for line in result.stdout.splitlines():
            self.assertTrue(re.match(r"^(\[rank \d\] |forge launch: )", line), line)

    def test_a_forge_subcommand_runs_this_binary(self):
        result = launch("--", "info", "debug-tiny")
        self.assertEqual(result.returncode, 0, result.stderr)
        for rank in range(2):
            self.assertTrue(any(line.startswith("parameters") for line in rank_lines(result.stdout, rank)),
                            result.stdout)


class Failures(unittest.TestCase):
    def test_all_ranks_succeed(self):
        result = launch("--", "sh", "-c", "exit 0", nproc=4)
        self.assertEqual(result.returncode, 0, result.stderr)

    def test_a_failing_rank_stops_its_sleeping_peers(self):
        script = 'if [ "$RANK" = 1 ]; then sleep 0.3; echo "rank 1 gives up" >&2; exit 3; fi; sleep 60'
        start = time.monotonic()
        result = launch("--", "sh", "-c", script, nproc=3)
        self.assertLess(time.monotonic() - start, 10)
        self.assertEqual(result.returncode, 3)
        self.assertIn("[rank 1] rank 1 gives up", result.stderr)
        self.assertIn("forge launch: rank 1 exited with code 3; stopping the other ranks", result.stderr)
        self.assertNotIn("sent SIGKILL", result.stderr)

    def test_a_rank_killed_by_a_signal_is_reported(self):
        script = 'if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 60'
        result = launch("--", "sh", "-c", script)
        self.assertEqual(result.returncode, 128 + 9)
        self.assertIn("rank 0 was killed by signal 9 (SIGKILL)", result.stderr)

    def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(self):
        # Rank 1 fails only once rank 0 has set its trap: a SIGTERM that came before the trap
        # would end rank 0 at once and the grace period would never be tested.
        with tempfile.TemporaryDirectory() as tmp:
            ready = os.path.join(tmp, "trapped")
            script = (f'if [ "$RANK" = 1 ]; then while [ ! -e {ready} ]; do sleep 0.01; done; exit 5; fi; '
                      f'trap "" TERM; touch {ready}; sleep 60')
            start = time.monotonic()
            result = launch("--grace-period", "1", "--", "sh", "-c", script)
        elapsed = time.monotonic() - start
        self.assertEqual(result.returncode, 5)
        self.assertGreaterEqual(elapsed, 1)
        self.assertLess(elapsed, 10)
        self.assertIn("rank 0 (or programs it started) still running after 1 s: sent SIGKILL", result.stderr)

    def test_a_program_that_does_not_exist(self):
        result = launch("--", "/nonexistent/program")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("cannot run '/nonexistent/program': No such file or directory", result.stderr)

    def test_bad_options(self):
        for args, fragment in [
            (["--"], "COMMAND is required"),
            (["--nnodes", "2", "--", "true"], "--master-addr"),
            (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--", "true"], "--node-rank 2"),
            (["--master-port", "70000", "--", "true"], "--master-port 70000"),
        ]:
            result = launch(*args)
            self.assertNotEqual(result.returncode, 0, args)
            self.assertIn(fragment, result.stderr + result.stdout, args)
        result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", "0", "--", "true"], capture_output=True,
                                text=True, timeout=TIMEOUT)
        self.assertNotEqual(result.returncode, 0)


class Signals(unittest.TestCase):
    GRACE = 2

    def start(self, nproc, *command):
        proc = subprocess.Popen([forge_bin(), "launch", "--nproc-per-node", str(nproc), "--grace-period",
                                 str(self.GRACE), "--",
                                 *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pids = []
        for line in proc.stdout:  # each rank reports its pid and its sleeping child's, then waits
            if "pids" in line:
                pids += [int(p) for p in line.split()[-2:]]
            if len(pids) == 2 * nproc:
                break
        return proc, pids

    def check_stops_everything(self, sig):
        proc, pids = self.start(3, "sh", "-c", 'sleep 60 & echo "pids $$ $!"; wait')
        start = time.monotonic()
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
        self.assertLess(time.monotonic() - start, self.GRACE + 3)
        self.assertEqual(proc.returncode, 128 + sig)
        self.assertIn(f"received signal {int(sig)} (SIG{signal.Signals(sig).name[3:]})", stderr)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual([p for p in pids if alive(p)], [])
        return stderr

    def test_sigterm_stops_every_rank_and_what_it_started(self):
        stderr = self.check_stops_everything(signal.SIGTERM)
        self.assertNotIn("sent SIGKILL", stderr)

    def test_sigint_stops_every_rank_and_what_it_started(self):
        # sh runs `sleep 60 &` with SIGINT ignored (POSIX, for background jobs without job
        # control), so the sleepers outlive their shells and die of the SIGKILL at the end
        # of the grace period.
        self.check_stops_everything(signal.SIGINT)


class Rendezvous(unittest.TestCase):
    def test_ranks_meet_over_tcp(self):
        result = launch("--", tool("forge_rendezvous"), "20000", nproc=4)
        self.assertEqual(result.returncode, 0, result.stderr)
        for rank in range(4):
            self.assertEqual(rank_lines(result.stdout, rank), [f"rank {rank} of 4 (torchrun): id ok"])

    def test_a_rank_that_never_comes_is_named_by_the_others(self):
        start = time.monotonic()
        result = launch("--", tool("forge_rendezvous"), "1500", "2", nproc=4)
        self.assertLess(time.monotonic() - start, 15)
        self.assertNotEqual(result.returncode, 0)
        # Rank 0 tells every waiting rank which rank is missing; whichever rank fails first
        # makes the launcher stop the others, so the message is looked for on any rank.
        self.assertIn("rank 2 did not connect within 1.5 s (3 of 4 ranks did)", result.stderr)
        self.assertRegex(result.stderr, r"forge launch: rank [013] exited with code 1")

    def test_slurm_variables_through_the_same_rendezvous(self):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(2):
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
            env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                       SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77",
                       MASTER_PORT=str(port))
            procs.append(subprocess.Popen([tool("forge_rendezvous"), "20000"], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
            self.assertEqual(proc.returncode, 0, stderr)
            self.assertEqual(stdout.strip(), f"rank {rank} of 2 (slurm): id ok")


if __name__ == "__main__":
    unittest.main()
