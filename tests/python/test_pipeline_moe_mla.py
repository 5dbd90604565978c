"""Mixture-of-Experts and Multi-head Latent Attention blocks under pipeline parallelism across
real CPU processes (forge launch, the CPU process group; NOTE [Pipeline stages] in
model/pipeline_stage.h): a 4-block debug-tiny-moe with the per-layer balancing loss and the
z-loss, and with the pooled one (its statistics carried across the stages), and a 4-block
debug-tiny-mla (MLA, a dense first block, MoE blocks with a shared expert) with the
sequence-wise balancing loss, on 2 pipeline ranks under 1F1B and the interleaved schedule,
follow one rank's losses (cross-entropy plus every stage's auxiliary losses), gradient norms
and validation losses; LoRA on the MLA model under pipelining too, and all-linear LoRA (the
routed experts' adapters included) on the MoE model; the routing biases' update (sigmoid
routing) from every stage's expert loads, on 2 pipeline ranks and with FSDP under them
(expert parallelism under pipelining: test_pipeline_expert_parallel.py; the global balancing
loss: test_pipeline_global_balancing.py).

Measured over the 20 steps, the largest relative differences from one rank: losses 9.0e-8,
gradient norms 3.4e-8, validation losses 1.5e-8 (the pooled loss's runs 4.1e-8, 6.5e-8 and
9.5e-9; the LoRA run's gradient norms bitwise: each adapter's gradient is one stage's, the
others add zeros). Routing is discrete, so a token whose top-k scores tied within fp32
reordering could change expert; the bound is the dense model's 1e-5."""
import os
import unittest

from forge_test_util import max_relative_difference, records, scratch_dir, train_on_ranks

STEPS = 20
TOLERANCE = 1e-5
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
MOE = ["--model.name", "debug-tiny-moe", "--model.num_layers", "4", "--model.router_aux_loss_coef", "0.01",
       "--model.router_aux_loss_type", "per_layer", "--model.router_z_loss_coef", "0.001"]
# transformers' Mixtral form, pooled over every block: its statistics cross the stages (NOTE
# [Pooled balancing loss across stages]).
POOLED = ["--model.name", "debug-tiny-moe", "--model.num_layers", "4", "--model.router_aux_loss_coef", "0.02",
          "--model.router_aux_loss_type", "pooled"]
MLA = ["--model.name", "debug-tiny-mla", "--model.num_layers", "4", "--model.router_aux_loss_coef", "0.01",
       "--model.router_aux_loss_type", "sequence"]
LORA = ["--lora.rank", "4", "--lora.target_modules", "q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate"]
# Attention, the router and the routed experts' stacks (NOTE [LoRA on routed experts]).
ALL_LINEAR = ["--lora.rank", "4", "--lora.target_modules", "all-linear"]


def train(run_dir, ranks, *overrides, check=True):
    return train_on_ranks(run_dir, ranks, 1, *overrides, steps=STEPS, check=check)


class MoeAndMlaStages(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    def expect_follows(self, run, one):
        for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "loss")):
            self.assertLess(max_relative_difference(records(run, kind), records(one, kind), key), TOLERANCE, key)

    def test_pipeline_ranks_follow_one(self):
        for model, flags in (("moe", MOE), ("moe-pooled", POOLED), ("mla", MLA), ("mla-lora", MLA + LORA),
                             ("moe-lora-all-linear", MOE + ALL_LINEAR)):
            one = os.path.join(self.tmp, f"{model}-one")
            train(one, 1, *flags)
            trained = records(one, "train")
            self.assertLess(trained[-1]["loss"], trained[0]["loss"] - 0.1, model)
            for name, schedule, log in (("pp2", [], "pipeline rank 1 of 2: blocks 2-3 and the head"),
                                        ("pp2-interleaved", INTERLEAVED,
                                         "pipeline rank 0 of 2: blocks 0, 2 and the embedding")):
                with self.subTest(model=model, run=name):
                    run = os.path.join(self.tmp, f"{model}-{name}")
                    result = train(run, 2, *flags, *PP2, *schedule)
                    self.assertIn(log, result.stdout + result.stderr)
                    self.expect_follows(run, one)

    def test_routing_bias_update_takes_every_stage_loads(self):
        # Sigmoid routing with DeepSeek-V3's bias update (NOTE [Routing bias update]): each
        # stage's loads summed over the pipeline, every rank logging the whole model's and
        # moving its own blocks' biases, follow one rank's, the loads equal over the first 5 steps
        # (the update moves the biases from step 2 on; as test_fsdp.py's). On
        # 2 pipeline ranks and on 2 x 2 with FSDP (ZeRO-1) under them.
        flags = ["--model.name", "debug-tiny-moe", "--model.num_layers", "4", "--model.router_score_function",
                 "sigmoid", "--model.router_bias_update_rate", "0.001"]
        one = os.path.join(self.tmp, "bias-one")
        train(one, 1, *flags)
        for name, ranks, data_ranks, extra in (
                ("pp2", 2, 1, []),
                ("pp2-fsdp2", 4, 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "1"])):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, f"bias-{name}")
                train_on_ranks(run, ranks, data_ranks, *flags, *PP2, *extra, steps=STEPS)
                self.expect_follows(run, one)
                loads = [r["expert_load"] for r in records(run, "train")][:5]
                self.assertEqual(loads, [r["expert_load"] for r in records(one, "train")][:5])
                self.assertEqual(len(loads[0]), 4)  # every block's, on the rank that logs


if __name__ == "__main__":
    unittest.main()
