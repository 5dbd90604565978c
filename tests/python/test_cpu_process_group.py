"""The CPU process group across real processes (NOTE [CPU process group]), with the
forge_cpu_group tool as the ranks. Under forge launch with 2, 3 and 4 ranks every rank
checks every collective's exact values (f32 and bf16, sum and avg, reduce_scatter's and
all_gather's chunk order, two splits whose groups work at once, a split of a split, 32 MiB
buffers, a group outliving the world), and the results are bit-identical across ranks;
all_to_all moves every rank's rows exactly (random counts with zeros, everything to one
rank, self-sends, f32, bf16 and int32 rows, on the world and on split groups at once) and
refuses bad arguments.
Ranks started directly (so that no launcher stops them before they speak) show that a
mismatch between ranks, a rank that exits and a rank that never calls end every rank with
the cause, at once or after the collective timeout, as do all_to_all row counts that do not
match between a sender and its receiver."""
import os
import socket
import subprocess
import time
import unittest

from forge_test_util import forge_bin, tool

# Every test finishes in seconds; this only keeps a broken group from hanging CI.
TIMEOUT = 60
HINT = "every rank of a group must make the same calls on it in the same order"


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_ranks(world, scenario, timeout_ms):
    """Starts `world` ranks of forge_cpu_group; returns (returncode, stdout, stderr) per rank."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([tool("forge_cpu_group"), scenario, str(timeout_ms)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
        results.append((proc.returncode, stdout, stderr))
    return results


def rank_lines(text, rank):
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


class Collectives(unittest.TestCase):
    def test_every_collective_on_two_three_and_four_ranks(self):
        for world in (2, 3, 4):
            with self.subTest(world=world):
                result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", str(world), "--",
                                         tool("forge_cpu_group"), "collectives"], capture_output=True, text=True,
                                        timeout=TIMEOUT)
                self.assertEqual(result.returncode, 0, result.stderr)
                digests = []
                for rank in range(world):
                    lines = rank_lines(result.stdout, rank)
                    self.assertEqual(lines[-1], f"rank {rank} of {world}: collectives ok", result.stdout)
                    digests.append([line for line in lines if line.startswith("digest ")])
                self.assertEqual(len(digests[0]), 2 * 2 * 3 + 2)  # all_reduce: dtype x op x size; all_gather
                for rank in range(1, world):
                    self.assertEqual(digests[rank], digests[0], f"rank {rank} differs from rank 0")

    def test_all_to_all_on_two_three_and_four_ranks(self):
        for world in (2, 3, 4):
            with self.subTest(world=world):
                result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", str(world), "--",
                                         tool("forge_cpu_group"), "all-to-all"], capture_output=True, text=True,
                                        timeout=TIMEOUT)
                self.assertEqual(result.returncode, 0, result.stderr)
                for rank in range(world):
                    lines = rank_lines(result.stdout, rank)
                    self.assertEqual(lines[-1], f"rank {rank} of {world}: all_to_all ok", result.stdout)


class Failures(unittest.TestCase):
    def check_every_rank(self, results, world, fragment):
        """Each of `results` (ranks 0, 1, ...) failed with `fragment`, the others hearing it from rank 0."""
        for rank, (code, _, stderr) in enumerate(results):
            self.assertEqual(code, 1, f"rank {rank}: {stderr}")
            self.assertIn(fragment, stderr, f"rank {rank}")
            if rank == 0:
                self.assertIn(f"error: rank 0 of {world}: ", stderr)
            else:
                self.assertIn(f"error: rank {rank} of {world}: rank 0 stopped the job: ", stderr)

    def test_a_size_mismatch_fails_every_rank_at_once_naming_the_ranks(self):
        start = time.monotonic()
        results = run_ranks(4, "mismatch-size", 30000)
        self.assertLess(time.monotonic() - start, 10)
        self.check_every_rank(results, 4, "collectives do not match across ranks: ranks 0-2 called all_reduce #1 "
                                       "(f32, 1000 elements, sum) on the world; rank 3 called all_reduce #1 "
                                       "(f32, 1001 elements, sum) on the world")
        self.assertIn(HINT, results[0][2])

    def test_another_collective_on_one_rank_fails_every_rank(self):
        results = run_ranks(3, "mismatch-kind", 30000)
        self.check_every_rank(results, 3, "ranks 0-1 called all_reduce #1 (f32, 1000 elements, sum) on the world; "
                                       "rank 2 called all_gather #1 (f32, 1000 elements per rank) on the world")

    def test_all_to_all_counts_that_do_not_match_fail_every_rank_naming_the_pair(self):
        start = time.monotonic()
        results = run_ranks(3, "mismatch-counts", 30000)
        self.assertLess(time.monotonic() - start, 10)
        self.check_every_rank(results, 3, "all_to_all #1 (f32, rows of 4 elements) on the world: the ranks' row "
                                       "counts do not match")
        for _, _, stderr in results:
            self.assertIn("rank 0 sends 2 rows to rank 2, which expects 3 from it", stderr)

    def test_forge_launch_exits_non_zero_on_a_mismatch(self):
        result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", "2", "--", tool("forge_cpu_group"),
                                 "mismatch-size"], capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(result.returncode, 1)
        self.assertIn("collectives do not match across ranks", result.stderr)
        self.assertRegex(result.stderr, r"forge launch: rank [01] exited with code 1")

    def test_a_rank_that_exits_ends_the_others_at_once_naming_it(self):
        start = time.monotonic()
        results = run_ranks(4, "early-exit", 30000)
        self.assertLess(time.monotonic() - start, 10)
        self.assertEqual(results[3][0], 0, results[3][2])
        self.check_every_rank(results[:3], 4, "all_reduce #1 (f32, 1000 elements, sum) on the world: rank 3 (")
        for _, _, stderr in results[:3]:
            self.assertIn("closed its connection (its process exited?)", stderr)

    def test_rank_zero_exiting_ends_the_others_at_once(self):
        start = time.monotonic()
        results = run_ranks(3, "rank0-exit", 30000)
        self.assertLess(time.monotonic() - start, 10)
        self.assertEqual(results[0][0], 0, results[0][2])
        for rank in (1, 2):
            code, _, stderr = results[rank]
            self.assertEqual(code, 1, stderr)
            self.assertRegex(stderr, rf"error: rank {rank} of 3: all_reduce #1 \(f32, 1000 elements, sum\) on the "
                                     r"world: rank 0 at 127\.0\.0\.1:\d+ closed the connection")

    def test_a_rank_that_never_calls_is_named_after_the_timeout(self):
        start = time.monotonic()
        results = run_ranks(3, "stall", 1000)
        self.assertLess(time.monotonic() - start, 10)
        self.assertEqual(results[2][0], 0, results[2][2])
        self.check_every_rank(results[:2], 3, "all_reduce #1 (f32, 1000 elements, sum) on the world: rank 2 did not "
                                           "arrive within 1 s (2 of 3 ranks did)")


if __name__ == "__main__":
    unittest.main()
