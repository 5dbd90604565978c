"""FSDP's FP8 all-gather of a Mixture-of-Experts and Multi-head Latent Attention model on CPU
ranks (precision.fp8_fsdp_all_gather; NOTE [FP8 all-gather pieces] in
src/distributed/fsdp_fp8_pieces.h): each routed expert's matrix is cast with its own scale
(its amax max-reduced over the ranks under tensorwise, its expert's history scale under
delayed), MLA's kv_a as its two row views, the router gathered in the compute dtype. The
codes and scales are those the gather of the compute weights (fp32 on the CPU) and each
expert's (each row view's) cast of the gathered weight produce, so the runs are bitwise the
same: debug-tiny-mla (MLA, a dense first block, then 8 routed experts and a shared one) on 2
ranks, tensorwise and delayed under ZeRO-3, tensorwise under ZeRO-1, the loss curve and
(delayed) the saved amax histories and scales equal; and so with precision.fp8_routed_experts
false (the stacks gathered in the compute dtype, the other projections as packed codes),
tensorwise under ZeRO-3 and delayed under ZeRO-1; and under expert parallelism 2 on 4 ranks
(the experts' slices gathered in the compute dtype over the ranks holding them), with the
switch on and off. Kept short (8 steps) to stay far under
ctest's limit; the dense model's runs are in test_fp8_fsdp_all_gather.py."""
import os
import shutil
import unittest

from test_fp8_fsdp import delayed_state, train
from forge_test_util import scratch_dir, train_losses

GATHER = ["--precision.fp8_fsdp_all_gather", "true"]
MODEL = ["--model.name", "debug-tiny-mla"]
STEPS = 8
CHECKPOINTS = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]


class Fp8AllGatherMoeMla(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_bitwise_the_compute_dtype_gather(self):
        for recipe, stage in (("tensorwise", 3), ("delayed", 3), ("tensorwise", 1)):
            with self.subTest(recipe=recipe, zero_stage=stage):
                runs = {}
                for name, extra in (("plain", []), ("fp8", GATHER)):
                    run_dir = os.path.join(self.tmp, f"{recipe}-zero{stage}-{name}")
                    train(run_dir, 2, *MODEL, "--precision.fp8", recipe, "--parallelism.zero_stage", str(stage),
                          "--training.steps", str(STEPS), *CHECKPOINTS, *extra)
                    runs[name] = run_dir
                plain, fp8 = train_losses(runs["plain"]), train_losses(runs["fp8"])
                self.assertEqual(len(fp8), STEPS)
                self.assertEqual(fp8, plain)
                self.assertLess(fp8[-1], fp8[0] - 0.1)  # it trained
                if recipe == "delayed":
                    state = delayed_state(runs["fp8"], 4)
                    self.assertTrue(state["active"])
                    self.assertEqual(state, delayed_state(runs["plain"], 4))

    def test_routed_experts_out_of_fp8_bitwise_the_compute_dtype_gather(self):
        # precision.fp8_routed_experts false: the routed experts' stacks travel in the compute
        # dtype with the router and the norms, the other projections as codes (packed), and
        # the experts run their compute-dtype path on the gathered stacks, as the bf16 gather's.
        for recipe, stage in (("tensorwise", 3), ("delayed", 1)):
            with self.subTest(recipe=recipe, zero_stage=stage):
                runs = {}
                for name, extra in (("plain", []), ("fp8", GATHER)):
                    run_dir = os.path.join(self.tmp, f"experts-off-{recipe}-zero{stage}-{name}")
                    train(run_dir, 2, *MODEL, "--precision.fp8", recipe, "--precision.fp8_routed_experts", "false",
                          "--parallelism.zero_stage", str(stage), "--training.steps", str(STEPS), *CHECKPOINTS,
                          *extra)
                    runs[name] = run_dir
                plain, fp8 = train_losses(runs["plain"]), train_losses(runs["fp8"])
                self.assertEqual(len(fp8), STEPS)
                self.assertEqual(fp8, plain)
                self.assertLess(fp8[-1], fp8[0] - 0.1)  # it trained
                if recipe == "delayed":
                    state = delayed_state(runs["fp8"], 4)
                    self.assertTrue(state["active"])
                    self.assertEqual(state, delayed_state(runs["plain"], 4))

    def test_expert_parallel_bitwise_the_compute_dtype_gather(self):
        # Expert parallelism 2 on 4 ranks: each block's expert part (the rank's 4 experts'
        # slices) travels in the compute dtype over the 2 ranks holding the same experts, the
        # dense part's projections as codes over all 4; the local experts' FP8 GEMMs (with the
        # switch on) cast their gathered slices themselves, as under the compute-dtype gather.
        for recipe, stage, routed in (("tensorwise", 3, "true"), ("tensorwise", 3, "false"), ("delayed", 1, "true")):
            with self.subTest(recipe=recipe, zero_stage=stage, fp8_routed_experts=routed):
                runs = {}
                for name, extra in (("plain", []), ("fp8", GATHER)):
                    run_dir = os.path.join(self.tmp, f"ep-{recipe}-zero{stage}-experts-{routed}-{name}")
                    train(run_dir, 4, *MODEL, "--precision.fp8", recipe, "--precision.fp8_routed_experts", routed,
                          "--parallelism.expert_parallel_degree", "2", "--parallelism.zero_stage", str(stage),
                          "--training.steps", str(STEPS), *CHECKPOINTS, *extra)
                    runs[name] = run_dir
                plain, fp8 = train_losses(runs["plain"]), train_losses(runs["fp8"])
                self.assertEqual(len(fp8), STEPS)
                self.assertEqual(fp8, plain)
                self.assertLess(fp8[-1], fp8[0] - 0.1)  # it trained
                if recipe == "delayed":
                    state = delayed_state(runs["fp8"], 4)
                    self.assertTrue(state["active"])
                    self.assertEqual(state, delayed_state(runs["plain"], 4))

if __name__ == "__main__":
    unittest.main()
