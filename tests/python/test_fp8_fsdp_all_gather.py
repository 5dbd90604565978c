"""FSDP's FP8 all-gather on CPU ranks (precision.fp8_fsdp_all_gather; NOTE [FP8 all-gather] in
src/distributed/fsdp.h): each rank casts its master chunk of every block projection to E4M3
with the whole weight's scale (tensorwise: its amax max-reduced over the ranks; delayed: the
history's scale) and the ranks gather the codes. The codes and scales are those the gather of
the compute weights (fp32 on the CPU) and the cast of the gathered weight produce, so the runs
are bitwise the same: debug-tiny on 2 ranks, tensorwise and delayed, ZeRO-3 and ZeRO-1, the
loss curve and (delayed) the saved amax histories and scales equal; a delayed run stopped and
resumed with the FP8 gather is bitwise the uninterrupted one; and the key is refused where it
does not apply, naming it."""
import os
import shutil
import unittest

from test_fp8_fsdp import STEPS, check_delayed_resume_is_exact, delayed_state, train
from forge_test_util import scratch_dir, train_losses

GATHER = ["--precision.fp8_fsdp_all_gather", "true"]
CHECKPOINTS = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]


class Fp8AllGather(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_bitwise_the_compute_dtype_gather(self):
        for recipe in ("tensorwise", "delayed"):
            for stage in (3, 1):
                with self.subTest(recipe=recipe, zero_stage=stage):
                    runs = {}
                    for name, extra in (("plain", []), ("fp8", GATHER)):
                        run_dir = os.path.join(self.tmp, f"{recipe}-zero{stage}-{name}")
                        train(run_dir, 2, "--precision.fp8", recipe, "--parallelism.zero_stage", str(stage),
                              *CHECKPOINTS, *extra)
                        runs[name] = run_dir
                    plain, fp8 = train_losses(runs["plain"]), train_losses(runs["fp8"])
                    self.assertEqual(len(fp8), STEPS)
                    self.assertEqual(fp8, plain)
                    self.assertLess(fp8[-1], fp8[0] - 0.5)  # it trained
                    if recipe == "delayed":
                        self.assertEqual(delayed_state(runs["fp8"], 4), delayed_state(runs["plain"], 4))

    def test_lora_bitwise_the_compute_dtype_gather(self):
        """NOTE [FP8 all-gather of a frozen base]: LoRA's frozen FSDP base gathered as codes gives
        the bf16 gather's losses bit for bit: debug-tiny tensorwise and delayed under ZeRO-3 and
        ZeRO-1, debug-tiny-moe (its frozen routed experts as one piece each) tensorwise under
        ZeRO-3, 2 pipeline stages x FSDP 2 delayed and tensor 2 x FSDP 2 tensorwise under ZeRO-3,
        debug-tiny-moe under expert parallelism 2 (the experts' slices in bf16) delayed, and 2
        context-parallel ranks (FSDP shards over them) tensorwise."""
        lora = ["--lora.rank", "4", "--precision.fp8_amax_history_len", "8"]
        cases = [("tensorwise", "3", 2, []), ("tensorwise", "1", 2, []), ("delayed", "3", 2, []),
                 ("delayed", "1", 2, []), ("tensorwise", "3", 2, ["--model.name", "debug-tiny-moe"]),
                 ("delayed", "3", 4, ["--model.num_layers", "4", "--parallelism.pipeline_parallel_degree", "2",
                                      "--parallelism.data_parallel_shard_degree", "2"]),
                 ("tensorwise", "3", 4, ["--parallelism.tensor_parallel_degree", "2",
                                         "--parallelism.data_parallel_shard_degree", "2"]),
                 ("delayed", "3", 2, ["--model.name", "debug-tiny-moe", "--parallelism.expert_parallel_degree", "2"]),
                 ("tensorwise", "3", 2, ["--parallelism.context_parallel_degree", "2",
                                         "--parallelism.data_parallel_shard_degree", "1"])]
        for case, (recipe, stage, ranks, extra) in enumerate(cases):
            with self.subTest(recipe=recipe, zero_stage=stage, extra=extra):
                runs = {}
                for name, gather in (("plain", []), ("fp8", GATHER)):
                    run_dir = os.path.join(self.tmp, f"lora-{case}-{name}")
                    result = train(run_dir, ranks, "--precision.fp8", recipe, "--parallelism.zero_stage", stage, *lora,
                                   *extra, *gather)
                    if gather:
                        self.assertIn("as E4M3 codes (precision.fp8_fsdp_all_gather)", result.stdout)
                    runs[name] = train_losses(run_dir)
                self.assertEqual(len(runs["fp8"]), STEPS)
                self.assertEqual(runs["fp8"], runs["plain"])

    def test_the_fp8_head_gathered_as_codes(self):
        """NOTE [FP8 all-gather of the head]: with precision.fp8_output_head the head's weight
        travels as codes too, bitwise the bf16 gather's losses (and delayed state): tensorwise
        under ZeRO-3 and ZeRO-2, delayed under ZeRO-1, tensor 2 x FSDP 2 (the vocabulary-parallel
        head's amax over both groups), 2 pipeline stages x FSDP 2 (the last stage's head), and
        LoRA's frozen head."""
        head = ["--precision.fp8_output_head", "true", "--precision.fp8_amax_history_len", "8"]
        cases = [("tensorwise", "3", 2, []), ("tensorwise", "2", 2, []), ("delayed", "1", 2, []),
                 ("delayed", "3", 4, ["--parallelism.tensor_parallel_degree", "2",
                                      "--parallelism.data_parallel_shard_degree", "2"]),
                 ("tensorwise", "1", 4, ["--model.num_layers", "4", "--parallelism.pipeline_parallel_degree", "2",
                                         "--parallelism.data_parallel_shard_degree", "2"]),
                 ("tensorwise", "3", 2, ["--lora.rank", "4"])]
        for case, (recipe, stage, ranks, extra) in enumerate(cases):
            with self.subTest(recipe=recipe, zero_stage=stage, extra=extra):
                runs = {}
                for name, gather in (("plain", []), ("fp8", GATHER)):
                    run_dir = os.path.join(self.tmp, f"head-{case}-{name}")
                    result = train(run_dir, ranks, "--precision.fp8", recipe, "--parallelism.zero_stage", stage,
                                   *head, *extra, *CHECKPOINTS, *gather)
                    if gather:
                        self.assertIn("and the head", result.stdout)
                    runs[name] = run_dir
                self.assertEqual(train_losses(runs["fp8"]), train_losses(runs["plain"]))
                if recipe == "delayed":
                    self.assertEqual(delayed_state(runs["fp8"], 4), delayed_state(runs["plain"], 4))

    def test_delayed_resume_is_exact(self):
        check_delayed_resume_is_exact(self, self.tmp, *GATHER)

    def test_refused_where_it_does_not_apply(self):
        cases = [(1, ["--precision.fp8", "tensorwise"], "data_parallel_shard_degree 1"),
                 (2, [], "precision.fp8 is none"),
                 (2, ["--precision.fp8", "tensorwise", "--lora.rank", "4", "--lora.quantize_base", "nf4"],
                  "NF4 base is not sharded")]
        for ranks, extra, says in cases:
            with self.subTest(ranks=ranks, extra=extra):
                result = train(os.path.join(self.tmp, "refused"), ranks, *extra, *GATHER, check=False)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn("precision.fp8_fsdp_all_gather", result.stdout + result.stderr)
                self.assertIn(says, result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
