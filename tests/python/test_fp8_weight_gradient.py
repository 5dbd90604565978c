"""precision.fp8_weight_gradient false through forge (NOTE [FP8 weight gradient switch] in
src/ops/fp8_linear.h): a debug-tiny run with the weight gradients in the compute dtype says so
in its log, trains, and starts from the all-FP8 run's loss (the forward is the same) and stays
near it; a delayed run may flip it at a resume; on 2 FSDP ranks it follows the one-rank run as FP8 runs do (test_fp8_fsdp's bound);
forge info counts 4 FLOPs per FP8 weight, not 6; and a run without precision.fp8, or a LoRA
run, is refused naming the key, with a non-zero exit."""
import os
import shutil
import subprocess
import unittest

from test_fp8_fsdp import TOLERANCE, max_relative_difference, train
from forge_test_util import forge_bin, scratch_dir, train_losses

OFF = ["--precision.fp8_weight_gradient", "false"]


class Fp8WeightGradient(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = scratch_dir()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_a_run_logs_trains_and_starts_from_the_fp8_loss(self):
        for recipe in ("tensorwise", "delayed"):
            with self.subTest(recipe=recipe):
                off, fp8 = (os.path.join(self.tmp, f"{recipe}-{name}") for name in ("off", "fp8"))
                result = train(off, 1, "--precision.fp8", recipe, *OFF)
                self.assertIn("the weight gradients in the compute dtype: precision.fp8_weight_gradient false",
                              result.stdout)
                train(fp8, 1, "--precision.fp8", recipe)
                losses, fp8_losses = train_losses(off), train_losses(fp8)
                self.assertEqual(losses[0], fp8_losses[0])
                self.assertNotEqual(losses, fp8_losses)
                self.assertLess(losses[-1], losses[0] - 0.5)
                self.assertLess(max_relative_difference(losses, fp8_losses), 0.02)

    def test_a_delayed_run_may_switch_at_a_resume(self):
        # The switch changes no checkpointed state: the histories go on from the saved ones.
        run_dir = os.path.join(self.tmp, "switch-at-resume")
        save = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
        train(run_dir, 1, "--precision.fp8", "delayed", *save)
        result = train(run_dir, 1, "--precision.fp8", "delayed", *save, *OFF, "--checkpoint.load_step", "8")
        self.assertIn("resuming from checkpoint", result.stdout + result.stderr)
        self.assertIn("precision.fp8_weight_gradient false", result.stdout)

    def test_fsdp_ranks_follow_one_rank(self):
        one, two = (os.path.join(self.tmp, f"fsdp-{n}") for n in ("one", "two"))
        train(one, 1, "--precision.fp8", "delayed", *OFF)
        train(two, 2, "--precision.fp8", "delayed", *OFF)
        self.assertLess(max_relative_difference(train_losses(two), train_losses(one)), TOLERANCE)

    def test_forge_info_counts_no_fp8_weight_gradient(self):
        shares = {}
        for name, extra in (("fp8", []), ("off", OFF)):
            out = subprocess.run([forge_bin(), "info", "llama3.1-8b", "--precision.fp8", "tensorwise", *extra],
                                 capture_output=True, text=True, timeout=60, check=True).stdout
            line = next(l for l in out.splitlines() if l.startswith("FP8 "))
            shares[name] = float(line.split("% of the FLOPs per token")[0].rsplit("(", 1)[1])
            if name == "off":
                self.assertIn("forward and input-gradient GEMMs (the weight gradients in bf16: "
                              "precision.fp8_weight_gradient false)", line)
        self.assertAlmostEqual(shares["off"], shares["fp8"] * 4 / 6, delta=0.06)

    def test_refused_without_fp8_and_under_lora(self):
        for extra, words in (([], "precision.fp8 is none"),
                             (["--precision.fp8", "tensorwise", "--lora.rank", "8"], "frozen")):
            with self.subTest(extra=extra):
                run_dir = os.path.join(self.tmp, "refused")
                result = subprocess.run([forge_bin(), "train", "--logging.run_dir", run_dir, *OFF, *extra],
                                        capture_output=True, text=True, timeout=60)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn("precision.fp8_weight_gradient = false (command line)", result.stderr)
                self.assertIn(words, result.stderr)
                self.assertFalse(os.path.exists(os.path.join(run_dir, "checkpoints")))


if __name__ == "__main__":
    unittest.main()
