"""Megatron's global balancing loss (model.router_aux_loss_type global) under pipeline
parallelism across real CPU processes (forge launch, the CPU process group; NOTE [Global
balancing loss across stages] in src/model/moe_feed_forward.h): each stage's models of its
micro-batches in flight count the step's micro-batches together, so micro-batch k's loss
averages the counts of micro-batches 0 .. k as one rank's does, each stage's blocks taking
their share of the sum over the layers; with data parallelism each chunk's counts are summed
over the stage's ranks (through the trainer's FSDP collectives) at every forward.

A 4-block debug-tiny-moe on 2 pipeline ranks under 1F1B and the interleaved schedule follows
one rank (4 micro-batches of 2 sequences per step): losses, gradient norms and validation
losses at every step. On 2 pipeline x 2 data-parallel ranks (FSDP ZeRO-1 over each stage's 2
ranks, 2 micro-batches of 2 sequences per rank and step) it follows one rank whose
micro-batches are the two ranks' together (4 sequences, 2 per step: NOTE [Data-parallel
steps]) at half the coefficient (the union's loss is the sum of the ranks', which the step
averages twice as many of), as test_fsdp.py's global test without pipelining: the losses and
gradient norms; so does 2 x 2 with each stage's 2 ranks an expert-parallel group as well
(each rank half the experts, the counts its own tokens' before the dispatch).

Measured over the 20 steps, the largest relative differences: losses 8.1e-8 (1F1B), 7.1e-8
(interleaved), 1.1e-7 and 6.8e-8 with data parallelism, 1.1e-7 with expert parallelism too;
gradient norms 5.8e-8, 5.8e-8, 1.3e-7, 1.8e-7 and 8.8e-8; validation losses 2.5e-8 and 1.2e-8
(14 s on 2 cores). Routing is discrete, so the bound is test_pipeline_moe_mla.py's 1e-5."""
import os
import unittest

from forge_test_util import max_relative_difference, records, scratch_dir, train_on_ranks

STEPS = 20
TOLERANCE = 1e-5
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
DP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "1"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
# Each stage's 2 ranks an expert-parallel group too (NOTE [Expert parallelism under pipeline
# parallelism]): the counts are each rank's own tokens' before the dispatch.
EP2 = ["--parallelism.expert_parallel_degree", "2"]
GLOBAL = ["--model.name", "debug-tiny-moe", "--model.num_layers", "4", "--model.router_aux_loss_type", "global",
          "--model.init_std", "0.1"]
# One rank reading the two data-parallel ranks' micro-batches as one.
UNION = ["--training.local_batch_size", "4", "--training.gradient_accumulation_steps", "2"]


def coefficient(value):
    return ["--model.router_aux_loss_coef", str(value)]


class GlobalBalancingLossStages(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    def expect_follows(self, run, one, keys):
        for kind, key in keys:
            difference = max_relative_difference(records(run, kind), records(one, kind), key)
            print(f"{os.path.basename(run)}: {kind} {key} {difference:.2g}")
            self.assertLess(difference, TOLERANCE, key)

    def test_pipeline_ranks_follow_one(self):
        one = os.path.join(self.tmp, "one")
        train_on_ranks(one, 1, 1, *GLOBAL, *coefficient(0.2), steps=STEPS)
        # The balancing loss counts: without it the first step's loss is smaller.
        plain = os.path.join(self.tmp, "plain")
        train_on_ranks(plain, 1, 1, *GLOBAL, *coefficient(0), "--model.router_aux_loss_type", "pooled", steps=1)
        self.assertGreater(records(one, "train")[0]["loss"] - records(plain, "train")[0]["loss"], 0.05)
        for name, schedule in (("pp2", []), ("pp2-interleaved", INTERLEAVED)):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                train_on_ranks(run, 2, 1, *GLOBAL, *coefficient(0.2), *PP2, *schedule, steps=STEPS)
                self.expect_follows(run, one, (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")))

    def test_pipeline_and_data_parallel_ranks_follow_one_over_their_union(self):
        union = os.path.join(self.tmp, "union")
        train_on_ranks(union, 1, 1, *GLOBAL, *coefficient(0.1), *UNION, steps=STEPS)
        for name, layout in (("pp2-dp2", []), ("pp2-dp2-interleaved", INTERLEAVED), ("pp2-ep2", EP2)):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                train_on_ranks(run, 4, 2, *GLOBAL, *coefficient(0.2), *PP2, *DP2, *layout, steps=STEPS)
                self.expect_follows(run, union, (("train", "loss"), ("train", "grad_norm")))


if __name__ == "__main__":
    unittest.main()
