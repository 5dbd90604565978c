"""FP8 training under tensor parallelism on CPU ranks (forge launch, the CPU process group;
NOTE [FP8 under tensor parallelism] in src/model/fp8_projections.h): debug-tiny on 2
tensor-parallel ranks (and 2 x FSDP 2, and 2 x 2 pipeline ranks) in FP8, tensorwise and
delayed, follows the one-rank FP8 run; a delayed run's checkpointed histories and scales are
the one-rank run's; a delayed run stopped and resumed on the same ranks is bitwise the
uninterrupted one, and its checkpoint resumes on one rank; a non-finite amax on one rank
alone skips the step on both; LoRA with its frozen base's GEMMs in FP8 on 2 tensor-parallel
ranks (and 2 x FSDP 2) follows the one-rank LoRA FP8 run, its weight amaxes and scales one
rank's exactly; FSDP's FP8 all-gather on 2 x FSDP 2 is bitwise the compute-dtype gather (and
of LoRA's frozen base: test_fp8_fsdp_all_gather.py); what is not built is refused, naming
the keys.

What is exact and what is not: every amax of a sharded tensor (a weight's shard, a
row-parallel projection's input columns, a column-parallel projection's output-gradient
columns) is max-reduced over the group before its scale is computed, so every rank
quantizes with the scales one rank's whole tensors get, and with delayed scaling the step's
amaxes are max-reduced over the group at its end, so the histories are one rank's. One step
is then one rank's within fp32 reordering (tests/cpu/test_model_tensor_parallel.cpp: loss
9.1e-9, gradients 3.6e-7; here the first step's loss 2e-7 and gradient norm 5.7e-7). Over
the steps the row-parallel partial sums, added across the ranks in another order than one
rank's GEMM, leave the weights fp32 rounding apart, which Adam amplifies where a gradient
is near zero, and FP8 casts then round values near a code boundary either way: the same
drift as FSDP's reordered gradient reduction (test_fp8_fsdp.py: 1.1e-4 to 3.0e-4 over 20
steps, bound 1e-3). Measured over 20 steps (loss 3.49 -> 2.4), the largest relative loss
difference from one rank: tensorwise 2.7e-4, delayed 2.2e-4, 2 x FSDP 2 3.2e-4, 2 x 2
pipeline ranks 2.2e-4 (validation losses: 3.6e-4 at most); the bound is 1e-3, FSDP's. After one step the weights of the two
runs are fp32 rounding apart but for a few elements per matrix (at most 4 of 12288) that
Adam moved by up to 4.7e-4; the later steps' amaxes follow them: the step-4 histories are
within 2.9e-2 of one rank's and the scales 1.1e-2 (bound 0.1, as context parallelism's),
while the first step's amaxes, before any drift, are one rank's (checked within 1e-5;
measured 2.3e-7). Exact, and so checked bitwise: a resumed run is the uninterrupted one
(every rank takes rank 0's saved histories and scales, so ranks that disagreed would
quantize otherwise than in the uninterrupted run)."""
import json
import os
import shutil
import unittest

from safetensors.torch import load_file

from forge_test_util import (max_relative_difference, records, scratch_dir, train_on_ranks,
                             train_with_nan_on_rank_one)

STEPS = 20
TOLERANCE = 1e-3
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
DELAYED = ["--precision.fp8", "delayed", "--precision.fp8_amax_history_len", "8"]
TENSORWISE = ["--precision.fp8", "tensorwise"]
# name: ranks, data-parallel ranks, flags, recipe
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
LAYOUTS = {"tp2-tensorwise": (2, 1, TP2, "tensorwise"), "tp2-delayed": (2, 1, TP2, "delayed"),
           "tp2-fsdp2-delayed": (4, 2, TP2 + FSDP2, "delayed"), "tp2-pp2-delayed": (4, 1, TP2 + PP2, "delayed")}


def train(run_dir, ranks, data_ranks, *overrides, steps=STEPS, check=True):
    return train_on_ranks(run_dir, ranks, data_ranks, *overrides, steps=steps, check=check)


def recipe_flags(recipe):
    return DELAYED if recipe == "delayed" else TENSORWISE


def delayed_state(run_dir, step):
    with open(os.path.join(run_dir, "checkpoints", f"step-{step}", "metadata.json")) as f:
        return json.load(f)["fp8_delayed"]


def relative(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b) if y)


def resume(test, source, run_dir, ranks, data_ranks, *overrides, step=8):
    """SOURCE (a run that saved every 4 steps) copied to RUN_DIR and resumed from its step-STEP
    checkpoint on RANKS ranks: the train records it appended."""
    shutil.copytree(source, run_dir)
    before = len(records(run_dir, "train"))
    result = train(run_dir, ranks, data_ranks, *overrides, *SAVE, "--checkpoint.load_step", str(step))
    test.assertIn("resuming from checkpoint", result.stdout + result.stderr)
    resumed = records(run_dir, "train")[before:]
    test.assertEqual([r["step"] for r in resumed], list(range(step + 1, STEPS + 1)))
    return resumed


class Fp8UnderTensorParallelism(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.one = {}
        for recipe in ("tensorwise", "delayed"):
            cls.one[recipe] = os.path.join(cls.tmp, f"one-{recipe}")
            train(cls.one[recipe], 1, 1, *recipe_flags(recipe), *SAVE)
        cls.runs, cls.logs = {}, {}
        for name, (ranks, data_ranks, flags, recipe) in LAYOUTS.items():
            cls.runs[name] = os.path.join(cls.tmp, name)
            result = train(cls.runs[name], ranks, data_ranks, *flags, *recipe_flags(recipe), *SAVE)
            cls.logs[name] = result.stdout + result.stderr

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_tensor_parallel_ranks_follow_one(self):
        one = records(self.one["tensorwise"], "train")
        self.assertLess(one[-1]["loss"], one[0]["loss"] - 0.5)  # it trained
        for name, (_, data_ranks, _, recipe) in LAYOUTS.items():
            with self.subTest(run=name):
                run = self.runs[name]
                self.assertIn(f"FP8 {recipe}", self.logs[name])
                self.assertIn(f"tensor-parallel rank 1 of 2 (data-parallel rank 0 of {data_ranks})", self.logs[name])
                for kind in ("train", "eval"):
                    gap = max_relative_difference(records(run, kind), records(self.one[recipe], kind), "loss")
                    print(f"{name} {kind} loss: largest relative difference from one rank {gap:.3g}")
                    self.assertLess(gap, TOLERANCE, kind)
                if recipe != "delayed":
                    continue
                mine, reference = delayed_state(run, 4), delayed_state(self.one[recipe], 4)
                self.assertTrue(mine["active"])
                self.assertEqual([h == 0 for h in mine["histories"]], [h == 0 for h in reference["histories"]])
                # Each role's history, newest last: the first step's amaxes (before any drift) are
                # one rank's; the later steps' and the scales drift with the weights.
                length = mine["history_length"]
                first = relative(mine["histories"][length - 4::length], reference["histories"][length - 4::length])
                history_gap = relative(mine["histories"], reference["histories"])
                scale_gap = relative(mine["scales"], reference["scales"])
                print(f"{name} step-4 histories: the first step's {first:.3g} from one rank's, all {history_gap:.3g}, "
                      f"scales {scale_gap:.3g}")
                self.assertLess(first, 1e-5)
                self.assertLess(history_gap, 0.1)
                self.assertLess(scale_gap, 0.1)

    def test_delayed_resume_is_exact_and_resumes_on_one_rank(self):
        uninterrupted = {r["step"]: r["loss"] for r in records(self.runs["tp2-delayed"], "train")}
        resumed = resume(self, self.runs["tp2-delayed"], os.path.join(self.tmp, "tp2-resumed"), 2, 1, *TP2, *DELAYED)
        for r in resumed:
            self.assertEqual(r["loss"], uninterrupted[r["step"]], r["step"])
        alone = resume(self, self.runs["tp2-delayed"], os.path.join(self.tmp, "tp2-then-one"), 1, 1, *DELAYED)
        for r in alone:
            self.assertLess(abs(r["loss"] - uninterrupted[r["step"]]) / uninterrupted[r["step"]], TOLERANCE, r["step"])

    def test_a_non_finite_amax_on_one_rank_is_skipped_by_both(self):
        run_dir = os.path.join(self.tmp, "nan-skip")
        tensor = "layers.1.mlp.down.weight"
        result = train_with_nan_on_rank_one(run_dir, f"3:{tensor}@fp8_amax", *TP2, *TENSORWISE,
                                            "--training.on_nonfinite", "skip")
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn(f"first non-finite FP8 amax '{tensor}' weight W: amax nan (rank 1; 1 of 2 ranks saw one)",
                      result.stderr)
        self.assertEqual([bool(r.get("skipped")) for r in records(run_dir)], [False, False, True, False])


LORA = ["--lora.rank", "8", "--lora.alpha", "16", "--lora.target_modules", "all-linear"]
LORA_LAYOUTS = {"lora-tp2-tensorwise": (2, 1, TP2, "tensorwise"), "lora-tp2-delayed": (2, 1, TP2, "delayed"),
                "lora-tp2-fsdp2-delayed": (4, 2, TP2 + FSDP2, "delayed")}


def role_values(values, role, length=1):
    """The entries of ROLE (0 x, 1 W, 2 dy) of a per-projection [3][length] list."""
    return [v for i, v in enumerate(values) if (i // length) % 3 == role]


class LoraFp8UnderTensorParallelism(unittest.TestCase):
    """LoRA with the frozen base's GEMMs in FP8 (NOTE [FP8 frozen base]) on 2 tensor-parallel
    ranks (alone, and over FSDP's frozen base on 2 x 2 ranks): each rank runs the forward and
    input-gradient GEMMs of its shard of the base in FP8, the amaxes of the sharded tensors
    max-reduced over the group, so it follows the one-rank LoRA FP8 run as full training's does
    (same bound, 1e-3; measured over 20 steps: tensorwise 6.1e-5, delayed 2.3e-5, 2 x FSDP 2
    3.2e-5, validation 2.4e-5 at most). The frozen weights never change, so a weight's amax (and its delayed
    scale) is one rank's exactly: every W history and scale is checked equal to 1e-6; the
    activations' and gradients' follow the adapters, which drift within fp32 reordering
    (the first step's amaxes within 1e-5, as full training's; measured 2.3e-7, W histories and
    scales 0)."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.one = {}
        for recipe in ("tensorwise", "delayed"):
            cls.one[recipe] = os.path.join(cls.tmp, f"lora-one-{recipe}")
            train(cls.one[recipe], 1, 1, *recipe_flags(recipe), *LORA, *SAVE)
        cls.runs, cls.logs = {}, {}
        for name, (ranks, data_ranks, flags, recipe) in LORA_LAYOUTS.items():
            cls.runs[name] = os.path.join(cls.tmp, name)
            result = train(cls.runs[name], ranks, data_ranks, *flags, *recipe_flags(recipe), *LORA, *SAVE)
            cls.logs[name] = result.stdout + result.stderr

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_tensor_parallel_ranks_follow_one(self):
        one = records(self.one["tensorwise"], "train")
        self.assertLess(one[-1]["loss"], one[0]["loss"] - 0.1)  # the adapters trained
        for name, (_, data_ranks, _, recipe) in LORA_LAYOUTS.items():
            with self.subTest(run=name):
                run = self.runs[name]
                self.assertIn(f"FP8 {recipe}", self.logs[name])
                self.assertIn("frozen base's", self.logs[name])
                self.assertIn(f"tensor-parallel rank 1 of 2 (data-parallel rank 0 of {data_ranks})", self.logs[name])
                for kind in ("train", "eval"):
                    mine, reference = records(run, kind), records(self.one[recipe], kind)
                    self.assertEqual([r["step"] for r in mine], [r["step"] for r in reference])
                    gap = max_relative_difference(mine, reference, "loss")
                    print(f"{name} {kind} loss: largest relative difference from one rank {gap:.3g}")
                    self.assertLess(gap, TOLERANCE, kind)
                # The PEFT adapter is saved whole: one rank's tensors, names and shapes.
                mine = load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))
                reference = load_file(os.path.join(self.one[recipe], "adapter", "adapter_model.safetensors"))
                self.assertEqual({k: tuple(v.shape) for k, v in mine.items()},
                                 {k: tuple(v.shape) for k, v in reference.items()})
                if recipe != "delayed":
                    continue
                mine, reference = delayed_state(run, 4), delayed_state(self.one[recipe], 4)
                self.assertTrue(mine["active"])
                length = mine["history_length"]
                self.assertEqual([h == 0 for h in mine["histories"]], [h == 0 for h in reference["histories"]])
                w_history = relative(role_values(mine["histories"], 1, length),
                                     role_values(reference["histories"], 1, length))
                w_scale = relative(role_values(mine["scales"], 1), role_values(reference["scales"], 1))
                first = relative(mine["histories"][length - 4::length], reference["histories"][length - 4::length])
                scale_gap = relative(mine["scales"], reference["scales"])
                print(f"{name} step-4 W histories {w_history:.3g} and W scales {w_scale:.3g} from one rank's; "
                      f"the first step's amaxes {first:.3g}, all scales {scale_gap:.3g}")
                self.assertLess(w_history, 1e-6)
                self.assertLess(w_scale, 1e-6)
                self.assertLess(first, 1e-5)
                self.assertLess(scale_gap, 0.1)


GATHER = ["--precision.fp8_fsdp_all_gather", "true"]
# name: recipe, ZeRO stage
GATHER_LAYOUTS = {"gather-tensorwise-zero3": ("tensorwise", 3), "gather-delayed-zero3": ("delayed", 3),
                  "gather-delayed-zero1": ("delayed", 1)}


class Fp8AllGatherUnderTensorParallelism(unittest.TestCase):
    """FSDP's FP8 all-gather (NOTE [FP8 all-gather] in src/distributed/fsdp.h) on 2 tensor-parallel
    x 2 FSDP ranks: each rank casts its master chunk of its tensor-parallel shard of every block
    projection to E4M3 with the whole weight's scale (tensorwise: the chunk amaxes max-reduced over
    the shard group, then over the tensor-parallel ranks; delayed: the history's scale, agreed over
    both at the step's end) and the shard group gathers the codes. Those are the bytes the run that
    gathers the compute weights (fp32 on the CPU) writes when each projection casts its gathered
    shard with the amax max-reduced over the tensor-parallel group, so the two runs are bitwise the
    same: every step's loss, and (delayed) the saved histories and scales; both follow the one-rank
    FP8 run within the bound above (measured 3.5e-4). Without the tensor-parallel reduction of
    the gathered amaxes the first step's loss already differs (checked by hand: 3.48670 against
    3.48661)."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.runs, cls.logs = {}, {}
        for recipe in {recipe for recipe, _ in GATHER_LAYOUTS.values()}:
            cls.runs[f"one-{recipe}"] = os.path.join(cls.tmp, f"one-{recipe}")
            train(cls.runs[f"one-{recipe}"], 1, 1, *recipe_flags(recipe), *SAVE)
        for name, (recipe, stage) in GATHER_LAYOUTS.items():
            for kind, extra in (("plain", []), ("fp8", GATHER)):
                run_dir = os.path.join(cls.tmp, f"{name}-{kind}")
                result = train(run_dir, 4, 2, *TP2, *FSDP2, *recipe_flags(recipe), "--parallelism.zero_stage",
                               str(stage), *SAVE, *extra)
                cls.runs[f"{name}-{kind}"], cls.logs[f"{name}-{kind}"] = run_dir, result.stdout + result.stderr

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_bitwise_the_compute_dtype_gather(self):
        for name, (recipe, _) in GATHER_LAYOUTS.items():
            with self.subTest(run=name):
                plain, fp8 = self.runs[f"{name}-plain"], self.runs[f"{name}-fp8"]
                self.assertIn("tensor-parallel rank 1 of 2 (data-parallel rank 0 of 2)", self.logs[f"{name}-fp8"])
                for kind in ("train", "eval"):
                    mine, reference = records(fp8, kind), records(plain, kind)
                    self.assertEqual(len(mine), len(reference))
                    self.assertEqual([r["loss"] for r in mine], [r["loss"] for r in reference], kind)
                    gap = max_relative_difference(mine, records(self.runs[f"one-{recipe}"], kind), "loss")
                    print(f"{name} {kind} loss: bitwise the bf16-gather run's; largest relative difference from "
                          f"one rank {gap:.3g}")
                    self.assertLess(gap, TOLERANCE, kind)
                if recipe == "delayed":
                    for step in (4, 8):
                        self.assertEqual(delayed_state(fp8, step), delayed_state(plain, step), step)


class Refusals(unittest.TestCase):
    def test_what_is_not_built_is_refused_naming_the_keys(self):
        run_dir = os.path.join(scratch_dir(), "refused")
        for ranks, flags, message in (
                # QLoRA: debug-tiny's o shards (32 columns) would cut NF4's blocks of 64.
                (2, [*TP2, *LORA, "--lora.quantize_base", "nf4"],
                 "QLoRA under tensor parallelism over 2 ranks: each rank quantizes its 32 columns of layers.0"),):
            with self.subTest(flags=flags):
                result = train(run_dir, ranks, 2 if ranks == 4 else 1, *flags, steps=1, check=False)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(message, result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
