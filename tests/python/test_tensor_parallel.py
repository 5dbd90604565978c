"""Tensor parallelism with sequence parallelism across real processes on the CPU (forge
launch, the CPU process group; NOTE [Tensor parallelism] in model/tensor_parallel.h): the
same run on 2 and 4 tensor-parallel ranks, and on 2 tensor-parallel ranks times 2
data-parallel ranks (FSDP ZeRO-3 and ZeRO-1, hybrid sharding), gives one rank's loss curve,
gradient norms and validation losses within fp32 reordering; and the configurations tensor
parallelism cannot take are refused with errors that name the keys."""
import json
import os
import subprocess
import unittest

from forge_test_util import forge_bin, scratch_dir

TIMEOUT = 300
STEPS = 30
GLOBAL_BATCH = 8


def train(run_dir, ranks, data_ranks, *overrides, check=True):
    """STEPS steps on `ranks` CPU ranks, micro-batch 2, accumulation filling the global batch
    of 8 sequences over the data-parallel ranks; evaluation every 10 steps."""
    accum = GLOBAL_BATCH // (2 * data_ranks)
    args = ["train", "--training.steps", str(STEPS), "--training.local_batch_size", "2",
            "--training.gradient_accumulation_steps", str(accum), "--eval.interval", "10",
            "--logging.run_dir", run_dir, *overrides]
    command = [forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", *args] if ranks > 1 else [forge_bin(), *args]
    env = dict(os.environ, FORGE_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("type") == kind]


def max_relative_difference(a, b, key):
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b))


class Parity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    def run_dir(self, name):
        return os.path.join(self.tmp, name)

    def expect_follows(self, reference, run):
        self.assertLess(max_relative_difference(records(run, "train"), records(reference, "train"), "loss"), 1e-5)
        self.assertLess(max_relative_difference(records(run, "train"), records(reference, "train"), "grad_norm"), 1e-5)
        self.assertLess(max_relative_difference(records(run, "eval"), records(reference, "eval"), "loss"), 1e-5)

    def test_tensor_parallel_ranks_follow_one(self):
        one = self.run_dir("one")
        train(one, 1, 1)
        self.assertLess(records(one, "train")[-1]["loss"], records(one, "train")[0]["loss"] - 0.5)  # it trained
        for name, ranks, data_ranks, flags in (
                ("tp2", 2, 1, []),
                ("tp2-fsdp2", 4, 2, ["--parallelism.data_parallel_shard_degree", "2"]),
                ("tp2-fsdp2-zero1", 4, 2, ["--parallelism.data_parallel_shard_degree", "2",
                                           "--parallelism.zero_stage", "1"]),
                ("tp2-replicate2", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"])):
            with self.subTest(run=name):
                result = train(self.run_dir(name), ranks, data_ranks, "--parallelism.tensor_parallel_degree", "2",
                               *flags)
                self.expect_follows(one, self.run_dir(name))
                self.assertIn(f"tensor-parallel rank 1 of 2 (data-parallel rank 0 of {data_ranks})",
                              result.stdout + result.stderr)

    def test_four_ranks_split_every_head(self):
        mha = ["--model.name", "debug-tiny-mha"]
        train(self.run_dir("mha-one"), 1, 1, *mha)
        train(self.run_dir("mha-tp4"), 4, 1, *mha, "--parallelism.tensor_parallel_degree", "4",
              "--activation_checkpoint.mode", "full")
        self.expect_follows(self.run_dir("mha-one"), self.run_dir("mha-tp4"))


class Errors(unittest.TestCase):
    def expect_refused(self, ranks, flags, message):
        result = train(os.path.join(scratch_dir(), "refused"), ranks, 1, *flags, check=False)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(message, result.stdout + result.stderr)

    def test_bad_configurations_name_their_keys(self):
        tp = "--parallelism.tensor_parallel_degree"
        for ranks, flags, message in (
                (2, [tp, "3"], "splits the query heads of model debug-tiny (model.num_heads = 4), which 3 does not divide"),
                (2, [tp, "2", "--model.name", "debug-tiny-moe"], "has Mixture-of-Experts blocks"),
                (2, [tp, "2", "--model.name", "debug-tiny-mla"], "has Multi-head Latent Attention"),
                (2, [tp, "2", "--training.local_batch_size", "1", "--training.seq_len", "5"],
                 "must divide the micro-batch's tokens"),
                (2, [tp, "2", "--lora.rank", "4"], "cannot be combined with lora.rank = 4"),
                (2, [tp, "4", "--model.name", "debug-tiny-mha"], "tensor_parallel_degree = 1 × 1 × 4 = 4"),
                (1, [tp, "2"], "this process was started alone")):
            with self.subTest(flags=flags):
                self.expect_refused(ranks, flags, message)


if __name__ == "__main__":
    unittest.main()
