"""Mixture-of-Experts models (model.num_experts) trained end to end on the CPU with forge
train: debug-tiny-moe learns the built-in synthetic corpus down to near its entropy floor
as the dense default run does (logging each block's expert load every step), a stopped and resumed run is bitwise the uninterrupted one,
a MoE checkpoint refuses a dense model naming both, forge eval of the run gives its
validation loss, forge generate refuses --device cuda for it, and forge info counts Mixtral
8x7B's total and active parameters."""
import json
import os
import subprocess
import unittest

from forge_test_util import forge_bin, records, scratch_dir, train_losses

FLOOR_MARGIN = 0.15  # as the dense default run's (test_train_cli.py)
MOE = ["--model.name", "debug-tiny-moe"]


def forge(*args):
    return subprocess.run([forge_bin(), *args], capture_output=True, text=True)



class MoeTraining(unittest.TestCase):
    def test_default_run_reaches_the_entropy_floor(self):
        run_dir = os.path.join(scratch_dir(), "run")
        result = forge("train", *MOE, "--logging.run_dir", run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        floor = records(run_dir, "run")[0]["entropy_floor"]
        final = records(run_dir, "eval")[-1]["loss"]
        print(f"entropy floor {floor:.4f}, final eval loss {final:.4f}, gap {final - floor:.4f}")
        self.assertLess(final - floor, FLOOR_MARGIN)
        self.assertGreater(final, floor - 0.02)
        # Every step logs each block's routing: all tokens x top-2 assignments, over 4 experts.
        run_record = records(run_dir, "run")[0]
        for r in records(run_dir, "train"):
            self.assertEqual(len(r["expert_load"]), 2)
            for block in r["expert_load"]:
                self.assertEqual(len(block), 4)
                self.assertEqual(sum(block), run_record["tokens_per_step"] * 2)
            worst = max(max(b) * len(b) / sum(b) for b in r["expert_load"])
            self.assertAlmostEqual(r["expert_load_max_over_mean"], worst, places=12)
        self.assertIn("MoE load max/mean", result.stdout)

    def test_stop_and_resume_is_exact(self):
        full_dir = os.path.join(scratch_dir(), "full")
        self.assertEqual(forge("train", *MOE, "--training.steps", "12", "--logging.run_dir", full_dir).returncode, 0)
        run_dir = os.path.join(scratch_dir(), "run")
        common = [*MOE, "--logging.run_dir", run_dir, "--checkpoint.enable", "true", "--checkpoint.interval", "6"]
        self.assertEqual(forge("train", "--training.steps", "6", *common).returncode, 0)
        result = forge("train", "--training.steps", "12", *common)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("resuming from checkpoint", result.stdout)
        self.assertEqual(train_losses(run_dir), train_losses(full_dir))
        # The checkpoint is a MoE model's: a dense model is refused, naming both models.
        dense = forge("train", "--training.steps", "12", "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                      "--checkpoint.interval", "6", "--model.ffn_hidden_size", "96")
        self.assertNotEqual(dense.returncode, 0)
        self.assertIn("saved for model 'debug-tiny-moe': 2 layers, hidden 64, ffn 96 in 4 experts (top-2)", dense.stderr)
        self.assertIn("the configured model is 'debug-tiny'", dense.stderr)

    def test_eval_and_generate_of_a_moe_run(self):
        run_dir = os.path.join(scratch_dir(), "run")
        common = [*MOE, "--training.steps", "4", "--eval.interval", "4", "--eval.steps", "2"]
        result = forge("train", *common, "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                       "--checkpoint.interval", "4")
        self.assertEqual(result.returncode, 0, result.stderr)
        out = os.path.join(scratch_dir(), "eval.json")
        result = forge("eval", "--model", run_dir, "--json", out)
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(out) as f:
            self.assertAlmostEqual(json.load(f)["loss"], records(run_dir, "eval")[-1]["loss"], places=9)
        gpu = forge("generate", "--model", run_dir, "--device", "cuda", "--prompt", "x")
        self.assertNotEqual(gpu.returncode, 0)
        self.assertTrue("decodes those on the CPU only so far" in gpu.stderr or "no GPU is visible" in gpu.stderr,
                        gpu.stderr)

    def test_info_counts_active_parameters(self):
        result = forge("info", "mixtral-8x7b")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("ffn 14336 per expert, 8 experts, top-2", result.stdout)
        self.assertIn("46.70 B (46702792704 total", result.stdout)
        self.assertIn("active params    12.88 B per token (12879925248", result.stdout)


if __name__ == "__main__":
    unittest.main()
