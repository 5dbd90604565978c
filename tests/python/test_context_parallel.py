"""Context parallelism across real processes on the CPU (forge launch, the CPU process group;
NOTE [Context parallelism] in model/context_parallel.h, NOTE [Context-parallel steps] in
train/trainer.cpp): the same run with every sequence split over 2 and 4 context-parallel
ranks, composed with 2 tensor-parallel ranks, with FSDP over 2 data-parallel ranks and with
hybrid sharding, and with ring attention instead of the all-gather on 2 and 4 ranks (also
under a sliding window, both rotate methods), gives one rank's loss curve, gradient norms and validation losses within
fp32 reordering; a run resumed from its checkpoint repeats the uninterrupted one bitwise,
and its checkpoint resumes on one rank; the configurations it cannot take are refused with
errors that name the keys."""
import os
import unittest

from forge_test_util import max_relative_difference, records, scratch_dir, train_on_ranks



def train(run_dir, ranks, data_ranks, *overrides, steps=30, check=True):
    return train_on_ranks(run_dir, ranks, data_ranks, *overrides, steps=steps, check=check)


CP = "--parallelism.context_parallel_degree"
RING = "--parallelism.context_parallel_rotate_method"


class Parity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.one = os.path.join(cls.tmp, "one")
        train(cls.one, 1, 1)

    def expect_follows(self, run):
        for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
            self.assertLess(max_relative_difference(records(run, kind), records(self.one, kind), key), 1e-5, (kind, key))

    def test_context_parallel_ranks_follow_one(self):
        self.assertLess(records(self.one, "train")[-1]["loss"], records(self.one, "train")[0]["loss"] - 0.5)
        for name, ranks, data_ranks, flags in (
                ("cp2", 2, 1, [CP, "2"]),
                ("cp4-full", 4, 1, [CP, "4", "--activation_checkpoint.mode", "full"]),
                ("cp2-tp2", 4, 1, [CP, "2", "--parallelism.tensor_parallel_degree", "2"]),
                ("cp2-fsdp2", 4, 2, [CP, "2", "--parallelism.data_parallel_shard_degree", "2"]),
                ("cp2-replicate2", 4, 2, [CP, "2", "--parallelism.data_parallel_replicate_degree", "2"])):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                train(run, ranks, data_ranks, *flags)
                self.expect_follows(run)

    def test_ring_attention_follows_one(self):
        """NOTE [Ring attention]: parallelism.context_parallel_rotate_method p2p passes the keys
        and values around the ring instead of gathering them; the same curves within fp32
        reordering."""
        for name, ranks, data_ranks, flags in (
                ("cp2-ring", 2, 1, [CP, "2", RING, "p2p"]),
                ("cp4-ring-full", 4, 1, [CP, "4", RING, "p2p", "--activation_checkpoint.mode", "full"])):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                train(run, ranks, data_ranks, *flags)
                self.expect_follows(run)

    def test_sliding_window_follows_one(self):
        """NOTE [Ring attention with a sliding window]: model.sliding_window 40 with chunks of 32
        (2 ranks: a band and a trimmed band) and of 16 (4 ranks: full, band, trimmed and skipped
        pairs), through the ring and the all-gather, against one rank with the same window."""
        window = ["--model.sliding_window", "40"]
        one = os.path.join(self.tmp, "one-window")
        train(one, 1, 1, *window)
        for name, ranks, flags in (("cp2-ring-window", 2, [CP, "2", RING, "p2p"]),
                                   ("cp4-ring-window", 4, [CP, "4", RING, "p2p"]),
                                   ("cp2-allgather-window", 2, [CP, "2", RING, "allgather"])):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                train(run, ranks, 1, *flags, *window)
                for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
                    self.assertLess(max_relative_difference(records(run, kind), records(one, kind), key), 1e-5,
                                    (name, kind, key))

    def test_resume_is_exact_and_reshards(self):
        """2 context-parallel ranks, and 2 x 2 with tensor parallelism (whose checkpoints hold
        the shards, NOTE [Tensor-parallel checkpoints]): resumed at the layout that saved them,
        bitwise the uninterrupted run; resumed on one rank, within fp32 reordering."""
        ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "10"]
        for name, ranks, flags in (("cp2", 2, [CP, "2"]),
                                   ("cp2-tp2", 4, [CP, "2", "--parallelism.tensor_parallel_degree", "2"])):
            with self.subTest(layout=name):
                whole, cut = os.path.join(self.tmp, f"{name}-whole"), os.path.join(self.tmp, f"{name}-cut")
                train(whole, ranks, 1, *flags)
                train(cut, ranks, 1, *flags, *ckpt, steps=20)
                train(cut, ranks, 1, *flags, *ckpt, "--checkpoint.load_step", "10")
                expected = {r["step"]: r["loss"] for r in records(whole, "train")}
                resumed = records(cut, "train")
                self.assertEqual(resumed[-1]["step"], 30)
                for r in resumed:
                    self.assertEqual(r["loss"], expected[r["step"]], r["step"])
                alone = os.path.join(self.tmp, f"{name}-then-one")
                train(alone, 1, 1, "--checkpoint.enable", "true", "--checkpoint.folder",
                      os.path.join(cut, "checkpoints"), "--checkpoint.load_step", "20")
                tail = records(alone, "train")
                self.assertEqual(tail[0]["step"], 21)
                for r in tail:
                    self.assertLess(abs(r["loss"] - expected[r["step"]]) / expected[r["step"]], 1e-5, r["step"])


class Errors(unittest.TestCase):
    def expect_refused(self, ranks, flags, message):
        result = train(os.path.join(scratch_dir(), "refused"), ranks, 1, *flags, check=False)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(message, result.stdout + result.stderr)

    def test_bad_configurations_name_their_keys(self):
        for ranks, flags, message in (
                (2, [CP, "2", "--training.seq_len", "30"], "cuts each sequence into 4 chunks (two per rank), which must divide training.seq_len = 30"),
                (2, [CP, "2", "--model.name", "debug-tiny-moe"], "has Mixture-of-Experts blocks"),
                (2, [CP, "2", RING, "p2p", "--data.source", "sft", "--data.path", "/nonexistent/sft.jsonl",
                     "--model.sliding_window", "4"],
                 "ring attention takes packed examples or a sliding window, not both"),
                (2, [CP, "4"], "pipeline_parallel_degree = 1 × 1 × 1 × 4 × 1 = 4"),
                (1, [CP, "2"], "this process was started alone")):
            with self.subTest(flags=flags):
                self.expect_refused(ranks, flags, message)


if __name__ == "__main__":
    unittest.main()
