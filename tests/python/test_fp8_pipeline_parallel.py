"""FP8 training under pipeline parallelism on CPU ranks (forge launch, the CPU process group;
NOTE [FP8 under context and pipeline parallelism] in src/train/trainer_fp8.cpp): a 4-block
debug-tiny on 2 pipeline ranks (1F1B, the interleaved schedule, and 2 stages x FSDP 2) in
FP8, tensorwise and delayed, follows the one-rank FP8 run (and so do 2 stages x 2
context-parallel ranks); every rank holds the whole model's delayed state, so rank 0's
checkpoint has every stage's histories (the one-rank run's), a delayed run stopped and resumed on 2 ranks is bitwise the uninterrupted one, and
its checkpoint resumes on one rank and under the interleaved schedule (and a one-rank
checkpoint on 2 ranks); a non-finite amax on the last stage alone stops both ranks naming
it; FSDP over a stage's ranks gathering its blocks as E4M3 codes (precision.fp8_fsdp_all_gather)
gives bitwise the compute-dtype gather's runs.

What is exact and what is not: a pipeline rank quantizes whole micro-batches as one rank
does, and the delayed histories are max-reduced over the pipeline, so the first steps are
one rank's within fp32 reordering (measured 1.5e-8 for 4 steps) and the step-4 histories are
one rank's (measured bitwise, every layout without context parallelism; the bound 1e-5). After that the gradients'
summation order moves weights by fp32 rounding, which Adam and the FP8 code boundaries
amplify as under FSDP (test_fp8_fsdp.py): measured over the 20 steps, the largest relative
loss difference from one rank 2.0e-4 (tensorwise and delayed), 1.5e-4 (interleaved), 7.1e-5
(2 stages x FSDP 2), 1.3e-4 (2 stages x 2 context-parallel ranks, whose step-4 histories are
3e-2 from one rank's as under context parallelism alone), validation losses 4.2e-4 at most;
the bound is 2e-3."""
import json
import os
import shutil
import unittest

from forge_test_util import (max_relative_difference, records, scratch_dir, train_on_ranks,
                             train_with_nan_on_rank_one)

STEPS = 20
TOLERANCE = 2e-3
LAYERS = ["--model.num_layers", "4"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "1"]
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.zero_stage", "1"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
DELAYED = ["--precision.fp8", "delayed", "--precision.fp8_amax_history_len", "8"]
TENSORWISE = ["--precision.fp8", "tensorwise"]
GATHER = ["--precision.fp8_fsdp_all_gather", "true"]


def train(run_dir, ranks, *overrides, data_ranks=1, steps=STEPS, check=True):
    return train_on_ranks(run_dir, ranks, data_ranks, *LAYERS, *overrides, steps=steps, check=check)


def delayed_state(run_dir, step):
    with open(os.path.join(run_dir, "checkpoints", f"step-{step}", "metadata.json")) as f:
        return json.load(f)["fp8_delayed"]


def relative(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b) if y)


def resume(test, source, run_dir, ranks, *overrides, step=8):
    """SOURCE (a run that saved every 4 steps) copied to RUN_DIR and resumed from its step-STEP
    checkpoint on RANKS ranks: the train records it appended."""
    shutil.copytree(source, run_dir)
    before = len(records(run_dir, "train"))
    result = train(run_dir, ranks, *overrides, *SAVE, "--checkpoint.load_step", str(step))
    test.assertIn("resuming from checkpoint", result.stdout + result.stderr)
    resumed = records(run_dir, "train")[before:]
    test.assertEqual([r["step"] for r in resumed], list(range(step + 1, STEPS + 1)))
    return resumed


class Fp8UnderPipelineParallelism(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()
        cls.one = {}
        for name, recipe in (("tensorwise", TENSORWISE), ("delayed", DELAYED)):
            cls.one[name] = os.path.join(cls.tmp, f"one-{name}")
            train(cls.one[name], 1, *recipe, *SAVE)
        cls.pp2_delayed = os.path.join(cls.tmp, "pp2-delayed")
        train(cls.pp2_delayed, 2, *PP2, *DELAYED, *SAVE)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def expect_follows(self, run, one):
        for kind in ("train", "eval"):
            self.assertLess(max_relative_difference(records(run, kind), records(one, kind), "loss"), TOLERANCE, kind)

    def test_pipeline_ranks_follow_one(self):
        one = records(self.one["tensorwise"], "train")
        self.assertLess(one[-1]["loss"], one[0]["loss"] - 0.5)  # it trained
        for name, ranks, data_ranks, flags, recipe in (
                ("pp2-tensorwise", 2, 1, PP2, "tensorwise"),
                ("pp2-delayed", 2, 1, PP2, "delayed"),
                ("pp2-interleaved-delayed", 2, 1, PP2 + INTERLEAVED + ["--activation_checkpoint.mode", "full"],
                 "delayed"),
                ("pp2-fsdp2-delayed", 4, 2, PP2 + FSDP2, "delayed"),
                ("pp2-cp2-delayed", 4, 1, PP2 + CP2, "delayed")):
            with self.subTest(run=name):
                run = os.path.join(self.tmp, name)
                if run != self.pp2_delayed:
                    result = train(run, ranks, *flags, *(DELAYED if recipe == "delayed" else TENSORWISE), *SAVE,
                                   data_ranks=data_ranks)
                    self.assertIn(f"FP8 {recipe}", result.stdout)
                self.expect_follows(run, self.one[recipe])
                if recipe != "delayed":
                    continue
                # Rank 0 holds only the first stage, and its checkpoint every stage's histories.
                mine, reference = delayed_state(run, 4), delayed_state(self.one[recipe], 4)
                self.assertTrue(mine["active"])
                self.assertEqual([h == 0 for h in mine["histories"]], [h == 0 for h in reference["histories"]])
                # Context parallelism's first step scales each rank's chunks (test_fp8_context_parallel.py).
                bound = 0.1 if "cp2" in name else 1e-5
                self.assertLess(relative(mine["histories"], reference["histories"]), bound)
                self.assertLess(relative(mine["scales"], reference["scales"]), bound)

    def test_delayed_resume_is_exact_and_reshards(self):
        uninterrupted = {r["step"]: r["loss"] for r in records(self.pp2_delayed, "train")}
        resumed = resume(self, self.pp2_delayed, os.path.join(self.tmp, "pp2-resumed"), 2, *PP2, *DELAYED)
        for r in resumed:
            self.assertEqual(r["loss"], uninterrupted[r["step"]], r["step"])
        for name, ranks, flags in (("then-one", 1, []), ("then-interleaved", 2, PP2 + INTERLEAVED)):
            with self.subTest(layout=name):
                tail = resume(self, self.pp2_delayed, os.path.join(self.tmp, f"pp2-{name}"), ranks, *flags, *DELAYED)
                for r in tail:
                    self.assertLess(abs(r["loss"] - uninterrupted[r["step"]]) / uninterrupted[r["step"]], TOLERANCE,
                                    r["step"])
        with self.subTest(layout="one-then-pp2"):
            single = {r["step"]: r["loss"] for r in records(self.one["delayed"], "train")}
            tail = resume(self, self.one["delayed"], os.path.join(self.tmp, "one-then-pp2"), 2, *PP2, *DELAYED)
            for r in tail:
                self.assertLess(abs(r["loss"] - single[r["step"]]) / single[r["step"]], TOLERANCE, r["step"])

    def test_a_non_finite_amax_on_the_last_stage_stops_both_ranks(self):
        run_dir = os.path.join(self.tmp, "nan-stop")
        tensor = "layers.3.mlp.down.weight"  # on pipeline rank 1
        result = train_with_nan_on_rank_one(run_dir, f"2:{tensor}@fp8_amax:1", *LAYERS, *PP2, *DELAYED)
        self.assertNotEqual(result.returncode, 0)
        expected = (f"FP8 (precision.fp8 delayed): the first non-finite amax, in parameter order, is '{tensor}' "
                    f"weight W: amax nan (rank 1; 1 of 2 ranks saw one)")
        errors = [line for line in (result.stdout + result.stderr).splitlines() if "error: non-finite step 2" in line]
        self.assertTrue(errors, result.stderr[-3000:])
        for line in errors:
            self.assertIn(expected, line)
        self.assertEqual([r["step"] for r in records(run_dir)], [1])

    def test_the_fp8_all_gather_is_the_compute_dtype_gather(self):
        """FSDP over a stage's ranks gathering its blocks as E4M3 codes (precision.fp8_fsdp_all_gather)
        gives bitwise the runs that gather them in the compute dtype: delayed under ZeRO-1 and 1F1B
        (the checkpointed histories and scales equal too), tensorwise under ZeRO-3 and the
        interleaved schedule with full recomputation."""
        for name, flags, recipe in (("pp2-fsdp2-delayed", PP2 + FSDP2, DELAYED),
                                    ("pp2-fsdp2-zero3-interleaved-tensorwise",
                                     PP2 + FSDP2 + ["--parallelism.zero_stage", "3", *INTERLEAVED,
                                                    "--activation_checkpoint.mode", "full"], TENSORWISE)):
            with self.subTest(run=name):
                plain = os.path.join(self.tmp, name)
                if not os.path.exists(plain):  # test_pipeline_ranks_follow_one may have run it
                    train(plain, 4, *flags, *recipe, *SAVE, data_ranks=2)
                gathered = os.path.join(self.tmp, name + "-fp8-gather")
                result = train(gathered, 4, *flags, *recipe, *SAVE, *GATHER, data_ranks=2)
                self.assertIn("gathered as E4M3 codes: precision.fp8_fsdp_all_gather", result.stdout)
                for kind in ("train", "eval"):
                    self.assertEqual([r["loss"] for r in records(gathered, kind)],
                                     [r["loss"] for r in records(plain, kind)], kind)
                if recipe == DELAYED:
                    self.assertEqual(delayed_state(gathered, 4), delayed_state(plain, 4))


if __name__ == "__main__":
    unittest.main()
