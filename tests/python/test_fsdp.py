"""FSDP across real processes on the CPU (forge launch, the CPU process group): the same
run on 1, 2 and 4 ranks, with gradient accumulation keeping the global batch equal, gives
the same loss curve within fp32 reordering; so do ZeRO-1, -2 and -3 and hybrid sharding
(2 shard ranks x 2 replicas); bf16 gradient reduction stays within bf16 noise; every rank
reports holding 1/N of the optimizer state; rank 0 alone writes the run directory; and
the configuration errors a data-parallel run can meet are clear."""
import json
import os
import re
import subprocess
import unittest

import numpy

from forge_test_util import forge_bin, scratch_dir

TIMEOUT = 300
STEPS = 30
GLOBAL_BATCH = 8


# DeepSeek-V3's routing with its auxiliary-loss-free balancing, at a rate that moves the
# routing within a few steps.
SIGMOID_BIAS_UPDATE = ["--model.router_score_function", "sigmoid", "--model.router_normalize_topk", "true",
                       "--model.router_num_groups", "4", "--model.router_topk_groups", "2",
                       "--model.router_bias_update_rate", "0.02"]


def train(run_dir, ranks, *overrides, check=True):
    """debug-tiny for STEPS steps on `ranks` CPU ranks, micro-batch 2, accumulation filling
    the global batch of 8 sequences."""
    accum = GLOBAL_BATCH // (2 * ranks)
    args = ["train", "--training.steps", str(STEPS), "--training.local_batch_size", "2",
            "--training.gradient_accumulation_steps", str(accum), "--eval.interval", "0",
            "--logging.run_dir", run_dir, "--parallelism.data_parallel_shard_degree", str(ranks), *overrides]
    command = [forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", *args] if ranks > 1 else [forge_bin(), *args]
    env = dict(os.environ, FORGE_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r.get("type") == "train"]


def max_relative_difference(a, b):
    assert len(a) == len(b) == STEPS, (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


class Parity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.single = losses(cls.train_run("single", 1))

    @classmethod
    def train_run(cls, name, ranks, *overrides):
        run_dir = os.path.join(cls.tmp, name)
        cls.last = train(run_dir, ranks, *overrides)
        return run_dir

    def test_two_and_four_ranks_follow_one(self):
        for ranks in (2, 4):
            with self.subTest(ranks=ranks):
                curve = losses(self.train_run(f"ranks{ranks}", ranks))
                self.assertLess(max_relative_difference(curve, self.single), 1e-4)
        self.assertLess(self.single[-1], self.single[0] - 0.5)  # it trained

    def test_moe_models_follow_one_rank(self):
        """Mixture-of-Experts models shard their experts with every other weight (no expert
        parallelism): each rank routes its own micro-batches, whose balancing losses weigh as
        on one rank; the logged loads are the sum over the ranks. Mixtral-style with the
        balancing loss, and DeepSeek-shaped (MLA, a dense first block, shared experts) under
        ZeRO-3 and ZeRO-1."""
        def records_of(run_dir):
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                return [r for r in map(json.loads, f) if r.get("type") == "train"]
        for name, flags in (("moe", ["--model.name", "debug-tiny-moe", "--model.router_aux_loss_coef", "0.01"]),
                            ("mla", ["--model.name", "debug-tiny-mla"]),
                            ("mla-zero1", ["--model.name", "debug-tiny-mla", "--parallelism.zero_stage", "1"]),
                            # Auxiliary-loss-free balancing: the biases move by the loads summed over
                            # the ranks, each rank its chunk of them (NOTE [Routing bias update]).
                            ("mla-bias-update", ["--model.name", "debug-tiny-mla", *SIGMOID_BIAS_UPDATE]),
                            ("mla-bias-update-zero1", ["--model.name", "debug-tiny-mla", "--parallelism.zero_stage",
                                                       "1", *SIGMOID_BIAS_UPDATE])):
            with self.subTest(model=name):
                one = records_of(self.train_run(f"{name}-1", 1, *flags))
                two = records_of(self.train_run(f"{name}-2", 2, *flags))
                self.assertLess(max_relative_difference([r["loss"] for r in two], [r["loss"] for r in one]), 1e-4)
                # With the bias update, steps 2 on route by the updated biases.
                self.assertEqual([r["expert_load"] for r in two][:5], [r["expert_load"] for r in one][:5])

    def test_global_balancing_loss_over_two_ranks_is_one_rank_over_their_union(self):
        """Megatron's global balancing loss (model.router_aux_loss_type global, NOTE [MoE
        balancing loss]): each micro-batch's tokens per expert are summed over the ranks (one
        reduction through the trainer's FSDP collectives, ZeRO-3 gathers in flight) and each
        rank's loss takes its own probabilities over every rank's tokens. The two ranks' a-th
        micro-batches of 2 sequences are one rank's a-th micro-batch of 4 (NOTE [Data-parallel
        steps]), whose loss is the sum of theirs; the step averages twice as many of the ranks'
        losses, so one rank with half the coefficient follows the same loss curve."""
        flags = ["--model.name", "debug-tiny-moe", "--model.router_aux_loss_type", "global", "--model.init_std", "0.1"]
        two = losses(self.train_run("global-2", 2, *flags, "--model.router_aux_loss_coef", "0.4"))
        one = losses(self.train_run("global-1", 1, *flags, "--model.router_aux_loss_coef", "0.2",
                                    "--training.local_batch_size", "4", "--training.gradient_accumulation_steps", "2"))
        self.assertLess(max_relative_difference(two, one), 1e-4)
        # Without the ranks' counts each rank's loss would be its own micro-batch's per-layer
        # loss, about twice as large: the coefficient's share of the loss shows it.
        plain = losses(self.train_run("global-none", 1, *flags, "--model.router_aux_loss_type", "pooled",
                                      "--model.router_aux_loss_coef", "0", "--training.local_batch_size", "4",
                                      "--training.gradient_accumulation_steps", "2"))
        self.assertGreater(one[0] - plain[0], 0.1)

    def test_evaluation_is_split_over_ranks(self):
        """NOTE [Evaluation under data parallelism]: 4 validation micro-batches on 2 ranks
        are 2 each, summed: the mean of 1 rank's 4; 3 are evaluated whole on every rank."""
        def evals(name, ranks, steps):
            run_dir = self.train_run(name, ranks, "--eval.interval", "15", "--eval.steps", str(steps))
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                return [r["loss"] for r in map(json.loads, f) if r.get("type") == "eval"], self.last
        for steps in (4, 3):
            with self.subTest(steps=steps):
                one, _ = evals(f"eval1-{steps}", 1, steps)
                two, result = evals(f"eval2-{steps}", 2, steps)
                self.assertEqual(len(one), 2)
                self.assertLess(max(abs(a - b) / b for a, b in zip(two, one)), 1e-4)
                noted = "every rank evaluates all of them" in result.stdout + result.stderr
                self.assertEqual(noted, steps == 3)

    def test_every_zero_stage_follows_one_rank(self):
        for stage in (1, 2):
            with self.subTest(stage=stage):
                curve = losses(self.train_run(f"zero{stage}", 2, "--parallelism.zero_stage", str(stage)))
                self.assertLess(max_relative_difference(curve, self.single), 1e-4)

    def test_hybrid_sharding_follows_one_rank(self):
        run_dir = os.path.join(self.tmp, "hybrid")
        result = subprocess.run(
            [forge_bin(), "launch", "--nproc-per-node", "4", "--", "train", "--training.steps", str(STEPS),
             "--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "1", "--eval.interval", "0",
             "--logging.run_dir", run_dir, "--parallelism.data_parallel_shard_degree", "2",
             "--parallelism.data_parallel_replicate_degree", "2"],
            capture_output=True, text=True, timeout=TIMEOUT, env=dict(os.environ, FORGE_NUM_THREADS="1"))
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertLess(max_relative_difference(losses(run_dir), self.single), 1e-4)
        self.assertIn("2 shard ranks x 2 replicas", result.stdout)

    def test_bf16_reduction_stays_close(self):
        curve = losses(self.train_run("bf16", 2, "--precision.reduce_dtype", "bf16"))
        self.assertLess(max_relative_difference(curve, self.single), 2e-2)

    def test_each_rank_holds_a_quarter_of_the_optimizer_state(self):
        self.train_run("memory", 4)
        fractions = {}
        for line in self.last.stdout.splitlines():
            m = re.match(r"\[rank (\d)\] .*fsdp rank (\d) of 4 \(ZeRO-3.*= 1/([\d.]+) of the model's", line)
            if m:
                self.assertEqual(m.group(1), m.group(2))
                fractions[int(m.group(1))] = float(m.group(3))
        self.assertEqual(sorted(fractions), [0, 1, 2, 3], self.last.stdout[-3000:])
        for rank, n in fractions.items():
            # Each unit is padded to a multiple of 4 x 64 elements: the padding (master
            # weights only; the moments skip it) lands mostly on the last rank.
            self.assertTrue(3.9 < n < 4.1, (rank, n))

    def test_rank_zero_alone_writes_the_run_directory(self):
        run_dir = self.train_run("writer", 2)
        def kinds(directory):
            return sorted(name.split(".")[0] if name.startswith("events.out.tfevents") else name
                          for name in os.listdir(directory))
        self.assertEqual(kinds(run_dir), kinds(os.path.join(self.tmp, "single")))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [r for r in map(json.loads, f) if r.get("type") == "train"]
        self.assertTrue(all(r["comm_exposed_s"] >= 0 for r in records))  # NOTE [Exposed communication]
        with open(os.path.join(self.tmp, "single", "metrics.jsonl")) as f:
            self.assertFalse(any("comm_exposed_s" in r for r in map(json.loads, f)))
        step_lines = [line for line in self.last.stdout.splitlines() if re.search(r"step +\d+/", line)]
        self.assertTrue(step_lines and all(line.startswith("[rank 0]") for line in step_lines), step_lines[:4])


class Errors(unittest.TestCase):
    def expect_error(self, ranks, fragments, *overrides):
        result = train(os.path.join(scratch_dir(), "run"), ranks, *overrides, check=False)
        self.assertNotEqual(result.returncode, 0)
        for fragment in fragments:
            self.assertIn(fragment, result.stderr)

    def test_shard_degree_minus_one_takes_every_rank(self):
        run_dir = os.path.join(scratch_dir(), "run")
        result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", "2", "--", "train", "--training.steps", "2",
                                 "--parallelism.data_parallel_shard_degree", "-1", "--logging.run_dir", run_dir],
                                capture_output=True, text=True, timeout=TIMEOUT, env=dict(os.environ, FORGE_NUM_THREADS="1"))
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertIn("fsdp rank 0 of 2 (ZeRO-3, 2 shard ranks x 1 replicas)", result.stdout)
        with open(os.path.join(run_dir, "config.yaml")) as f:
            self.assertIn("data_parallel_shard_degree: 2", f.read())
        self.expect_error(1, ["data_parallel_shard_degree = 0", "-1 for every rank"],
                          "--parallelism.data_parallel_shard_degree", "0")

    def test_degree_that_is_not_the_world_size(self):
        result = subprocess.run([forge_bin(), "train", "--parallelism.data_parallel_shard_degree", "2",
                                 "--logging.run_dir", os.path.join(scratch_dir(), "run")],
                                capture_output=True, text=True, timeout=TIMEOUT)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("forge launch --nproc-per-node 2", result.stderr)



class Bench(unittest.TestCase):
    def test_bench_on_two_ranks_reports_once(self):
        tmp = scratch_dir()
        result = subprocess.run(
            [forge_bin(), "launch", "--nproc-per-node", "2", "--", "bench", "--parallelism.data_parallel_shard_degree",
             "2", "--training.local_batch_size", "2,4", "--training.steps", "4", "--warmup", "1", "--output-dir",
             os.path.join(tmp, "out"), "--perf-csv", os.path.join(tmp, "perf.csv")],
            capture_output=True, text=True, timeout=TIMEOUT, env=dict(os.environ, FORGE_NUM_THREADS="1"))
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(os.path.join(tmp, "perf.csv")) as f:
            rows = f.read().splitlines()[1:]
        self.assertEqual(len(rows), 2, rows)
        with open(os.path.join(tmp, "out", "bench.json")) as f:
            runs = json.load(f)
        runs = runs["runs"] if isinstance(runs, dict) else runs
        self.assertEqual([r["n_gpus"] for r in runs], [2, 2])
        self.assertEqual(result.stdout.count("| Model |"), 1)


def checkpoint_weights(run_dir, step):
    """The flat fp32 parameters of checkpoint step-<step>, from every rank's file."""
    directory = os.path.join(run_dir, "checkpoints", f"step-{step}")
    with open(os.path.join(directory, "metadata.json")) as f:
        metadata = json.load(f)
    weights = []
    for rank, shard in enumerate(metadata["shards"]):
        count = shard["flat_end"] - shard["flat_begin"]
        weights.append(numpy.fromfile(os.path.join(directory, f"rank-{rank}.bin"), dtype="<f4", count=count))
    return numpy.concatenate(weights)


class Checkpoints(unittest.TestCase):
    def test_weights_after_one_step_match_across_world_sizes(self):
        tmp = scratch_dir()
        weights = {}
        for ranks in (1, 4):
            run_dir = os.path.join(tmp, f"ranks{ranks}")
            train(run_dir, ranks, "--training.steps", "1", "--checkpoint.enable", "true")
            weights[ranks] = checkpoint_weights(run_dir, 1)
        self.assertEqual(weights[1].shape, weights[4].shape)
        self.assertLess(float(numpy.abs(weights[4] - weights[1]).max()), 1e-6)

    def test_hybrid_run_saves_one_replica_and_resumes_on_four_shards(self):
        run_dir = os.path.join(scratch_dir(), "run")
        train(run_dir, 4, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.data_parallel_replicate_degree",
              "2", "--checkpoint.enable", "true", "--checkpoint.interval", "15")
        uninterrupted = losses(run_dir)
        with open(os.path.join(run_dir, "checkpoints", "step-15", "metadata.json")) as f:
            self.assertEqual(json.load(f)["world_size"], 2)  # the shard ranks of one replica wrote it
        train(run_dir, 4, "--checkpoint.enable", "true", "--checkpoint.load_step", "15")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [r for r in map(json.loads, f) if r.get("type") == "train"]
        resumed = [r["loss"] for r in steps[STEPS:]]
        self.assertEqual(len(resumed), STEPS - 15)
        self.assertLess(max(abs(a - b) / b for a, b in zip(resumed, uninterrupted[15:])), 1e-4)

    def test_async_saves_on_two_ranks_match_synchronous_ones(self):
        root = scratch_dir()
        runs = {}
        for mode in ("disabled", "async"):
            run_dir = os.path.join(root, mode)
            result = train(run_dir, 2, "--training.steps", "10", "--checkpoint.enable", "true", "--checkpoint.interval",
                           "5", "--checkpoint.async_mode", mode, "--checkpoint.buffer_mb", "1")
            runs[mode] = run_dir
        self.assertIn("asynchronous", result.stdout)
        self.assertEqual(losses(runs["async"]), losses(runs["disabled"]))
        for step in (5, 10):
            for name in ("metadata.json", "rank-0.bin", "rank-1.bin"):
                contents = []
                for mode in ("disabled", "async"):
                    with open(os.path.join(runs[mode], "checkpoints", f"step-{step}", name), "rb") as f:
                        contents.append(f.read())
                    if name == "metadata.json":  # the same but for the experiment's YAML (run_dir, async_mode)
                        contents[-1] = json.loads(contents[-1])
                        del contents[-1]["experiment_config"]
                self.assertTrue(contents[0] == contents[1], f"step-{step}/{name}")

    def test_two_ranks_save_and_resume_through_a_one_mib_buffer(self):
        """Each rank streams its segments into the shard files: a 190 MB checkpoint raises
        rank 0's peak resident memory by about the 1 MiB buffer, saving and resuming."""
        run_dir = os.path.join(scratch_dir(), "run")
        large = ["--model.hidden_size", "512", "--model.ffn_hidden_size", "2048", "--model.num_layers", "4",
                 "--training.seq_len", "16", "--checkpoint.enable", "true", "--checkpoint.interval", "1",
                 "--checkpoint.buffer_mb", "1"]
        logs = train(run_dir, 2, "--training.steps", "1", *large).stdout
        logs += train(run_dir, 2, "--training.steps", "2", *large).stdout
        self.assertGreater(float(re.search(r"\(([0-9.]+) MB in", logs).group(1)), 150)
        growths = [float(x) for x in re.findall(r"process peak resident memory \+([0-9.]+) MiB", logs)]
        if not growths and "peak host staging" in logs:
            self.skipTest("/proc/self/clear_refs cannot be written here: no peak resident memory to measure")
        self.assertEqual(len(growths), 3, logs)  # save, resume, save
        self.assertLess(max(growths), 12.0)

    def test_a_run_saved_on_two_ranks_resumes_on_one(self):
        run_dir = os.path.join(scratch_dir(), "run")
        train(run_dir, 2, "--checkpoint.enable", "true", "--checkpoint.interval", "15")
        uninterrupted = losses(run_dir)
        # Back to step 15, on one rank (accumulation 4 keeps the global batch).
        result = train(run_dir, 1, "--checkpoint.enable", "true", "--checkpoint.load_step", "15")
        self.assertIn("saved by 2 ranks", result.stdout)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [r for r in map(json.loads, f) if r.get("type") == "train"]
        resumed = [r["loss"] for r in steps[STEPS:]]
        self.assertEqual([r["step"] for r in steps[STEPS:]], list(range(16, STEPS + 1)))
        self.assertLess(max(abs(a - b) / b for a, b in zip(resumed, uninterrupted[15:])), 1e-4)


if __name__ == "__main__":
    unittest.main()
