"""Context parallelism on packed instruction data (data.source sft; NOTE [Chunk attention with
packed examples] in ops/attention_chunk.h) across real processes on the CPU: with sequences
of 32 tokens holding four 7-token examples and padding, split over 2 ranks (chunks of 8) and
4 (chunks of 4), the examples cross the ranks' chunks; the runs (also composed with 2
tensor-parallel ranks, FSDP over 2 data-parallel ranks and 2 pipeline stages) give one
rank's loss and gradient norm at every step and validation losses within fp32 reordering,
with the loss masked as the packed data masks it; so do ring attention's 2 and 4 ranks
(parallelism.context_parallel_rotate_method p2p, NOTE [Ring attention with packed examples]
in model/context_parallel_ring.h); so does LoRA (MLPerf's Llama 2 70B LoRA on
GovReport is this case)."""
import os
import shutil
import unittest

import test_train_sft as sft
from forge_test_util import max_relative_difference, records, scratch_dir, train_on_ranks

CP = "--parallelism.context_parallel_degree"
RING = "--parallelism.context_parallel_rotate_method"


class PackedParity(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.addClassCleanup(shutil.rmtree, cls.tmp, ignore_errors=True)
        cls.data = ["--data.source", "sft", "--data.path", sft.write_task(cls.tmp), "--data.split", "8,2,0",
                    "--training.seq_len", "32", "--eval.interval", "4"]
        cls.one = os.path.join(cls.tmp, "one")
        cls.train(cls.one, 1)

    @classmethod
    def train(cls, run_dir, ranks, *flags, data_ranks=1):
        return train_on_ranks(run_dir, ranks, data_ranks, *cls.data, *flags, steps=12)

    def test_context_parallel_ranks_follow_one_on_packed_examples(self):
        one = records(self.one, "train")
        self.assertEqual(len(one), 12)
        self.assertLess(one[-1]["loss"], one[0]["loss"])
        for name, ranks, data_ranks, flags in (
                ("cp2", 2, 1, [CP, "2"]),
                ("cp4-full", 4, 1, [CP, "4", "--activation_checkpoint.mode", "full"]),
                ("cp2-ring", 2, 1, [CP, "2", RING, "p2p"]),
                ("cp4-ring", 4, 1, [CP, "4", RING, "p2p", "--activation_checkpoint.mode", "selective"]),
                ("cp2-tp2", 4, 1, [CP, "2", "--parallelism.tensor_parallel_degree", "2"]),
                ("cp2-fsdp2", 4, 2, [CP, "2", "--parallelism.data_parallel_shard_degree", "2"]),
                ("cp2-pp2", 4, 1, [CP, "2", "--parallelism.pipeline_parallel_degree", "2",
                                   "--parallelism.zero_stage", "1"])):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                self.train(run, ranks, *flags, data_ranks=data_ranks)
                for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
                    self.assertLess(max_relative_difference(records(run, kind), records(self.one, kind), key), 1e-5,
                                    (kind, key))

    def test_lora_on_context_parallel_ranks_follows_one(self):
        lora = ["--lora.rank", "4", "--optimizer.lr", "1e-2"]
        one = os.path.join(self.tmp, "lora-one")
        self.train(one, 1, *lora)
        run = os.path.join(self.tmp, "lora-cp2")
        self.train(run, 2, CP, "2", *lora)
        for key in ("loss", "grad_norm"):
            self.assertLess(max_relative_difference(records(run, "train"), records(one, "train"), key), 1e-5, key)


if __name__ == "__main__":
    unittest.main()
