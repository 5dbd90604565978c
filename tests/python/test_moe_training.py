"""Mixture-of-Experts models (model.num_experts) trained end to end on the CPU with forge
train: debug-tiny-moe learns the built-in synthetic corpus down to near its entropy floor
as the dense default run does (logging each block's expert load every step), a stopped and resumed run is bitwise the uninterrupted one,
a MoE checkpoint refuses a dense model naming both, forge eval of the run gives its
validation loss, and forge info counts Mixtral
8x7B's total and active parameters. The same for a DeepSeek-shaped model (debug-tiny-mla:
Multi-head Latent Attention, a dense first block, shared experts), with sigmoid routing and
auxiliary-loss-free balancing's bias update (model.router_bias_update_rate) in its
checkpoints and resume, the update balancing the experts' load."""
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

    def test_token_dropping_run_learns_and_logs_what_it_dropped(self):
        """model.moe_capacity_factor 1.0 (NOTE [MoE capacity]): each expert keeps at most its share
        of a micro-batch's assignments; the run still reaches the floor, and every step logs the
        share of assignments dropped, the loads counting the kept ones."""
        run_dir = os.path.join(scratch_dir(), "run")
        result = forge("train", *MOE, "--model.moe_capacity_factor", "1.0", "--logging.run_dir", run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        floor = records(run_dir, "run")[0]["entropy_floor"]
        final = records(run_dir, "eval")[-1]["loss"]
        print(f"capacity 1.0: entropy floor {floor:.4f}, final eval loss {final:.4f}, gap {final - floor:.4f}")
        self.assertLess(final - floor, FLOOR_MARGIN)
        routed = records(run_dir, "run")[0]["tokens_per_step"] * 2  # per block, top-2
        shares = []
        for r in records(run_dir, "train"):
            kept = sum(sum(block) for block in r["expert_load"])
            self.assertAlmostEqual(r["expert_dropped_share"], 1.0 - kept / (2 * routed), places=12)
            shares.append(r["expert_dropped_share"])
        self.assertGreater(max(shares), 0.0)
        self.assertLess(max(shares), 0.5)
        self.assertIn("MoE dropped", result.stdout)
        dropless = os.path.join(scratch_dir(), "dropless")
        result = forge("train", *MOE, "--training.steps", "2", "--logging.run_dir", dropless)
        self.assertNotIn("MoE dropped", result.stdout)
        self.assertNotIn("expert_dropped_share", records(dropless, "train")[0])

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

    def test_stop_and_resume_with_the_global_balancing_loss_is_exact(self):
        """Megatron's global balancing loss averages each step's micro-batches' counts and
        starts over at every step: a run resumed at a step boundary computes the uninterrupted
        run's losses bitwise (its counts were forgotten there too)."""
        flags = [*MOE, "--model.router_aux_loss_type", "global", "--model.router_aux_loss_coef", "0.1",
                 "--training.gradient_accumulation_steps", "2"]
        full_dir = os.path.join(scratch_dir(), "full")
        result = forge("train", *flags, "--training.steps", "8", "--logging.run_dir", full_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        run_dir = os.path.join(scratch_dir(), "run")
        common = [*flags, "--logging.run_dir", run_dir, "--checkpoint.enable", "true", "--checkpoint.interval", "4"]
        self.assertEqual(forge("train", "--training.steps", "4", *common).returncode, 0)
        result = forge("train", "--training.steps", "8", *common)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("resuming from checkpoint", result.stdout)
        self.assertEqual(train_losses(run_dir), train_losses(full_dir))

    def test_eval_of_a_moe_run(self):
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

    def test_info_counts_active_parameters(self):
        result = forge("info", "mixtral-8x7b")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("8 experts of ffn 14336, top-2 (softmax scores, renormalized)", result.stdout)
        self.assertIn("46.70 B (46702792704 total", result.stdout)
        self.assertIn("active params    12.88 B per token (12879925248", result.stdout)
        dropping = forge("info", "mixtral-8x7b", "--model.moe_capacity_factor", "1.25", "--model.moe_pad_to_capacity",
                         "true")
        self.assertEqual(dropping.returncode, 0, dropping.stderr)
        self.assertIn("top-2 (softmax scores, renormalized), capacity factor 1.25 (drops by probs, padded to capacity)",
                      dropping.stdout)


MLA = ["--model.name", "debug-tiny-mla"]
SIGMOID = ["--model.router_score_function", "sigmoid", "--model.router_normalize_topk", "true",
           "--model.router_scaling_factor", "2.5", "--model.router_num_groups", "4", "--model.router_topk_groups", "2"]


class DeepseekTraining(unittest.TestCase):
    def test_tiny_mla_reaches_the_entropy_floor(self):
        run_dir = os.path.join(scratch_dir(), "run")
        result = forge("train", *MLA, "--logging.run_dir", run_dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        floor = records(run_dir, "run")[0]["entropy_floor"]
        final = records(run_dir, "eval")[-1]["loss"]
        print(f"debug-tiny-mla: entropy floor {floor:.4f}, final eval loss {final:.4f}, gap {final - floor:.4f}")
        self.assertLess(final - floor, FLOOR_MARGIN)
        # Two MoE blocks after the dense first one: each logs its 8 experts' loads.
        for r in records(run_dir, "train"):
            self.assertEqual([len(b) for b in r["expert_load"]], [8, 8])

    def test_stop_and_resume_with_routing_bias_updates_is_exact(self):
        flags = [*MLA, *SIGMOID, "--model.router_bias_update_rate", "0.01"]
        full_dir = os.path.join(scratch_dir(), "full")
        self.assertEqual(forge("train", *flags, "--training.steps", "12", "--logging.run_dir", full_dir).returncode, 0)
        run_dir = os.path.join(scratch_dir(), "run")
        common = [*flags, "--logging.run_dir", run_dir, "--checkpoint.enable", "true", "--checkpoint.interval", "6"]
        self.assertEqual(forge("train", "--training.steps", "6", *common).returncode, 0)
        result = forge("train", "--training.steps", "12", *common)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("resuming from checkpoint", result.stdout)
        self.assertEqual(train_losses(run_dir), train_losses(full_dir))
        # The checkpoint is an MLA model's without a compressed query: one with is refused, naming both.
        gqa = forge("train", "--training.steps", "12", "--logging.run_dir", run_dir, "--checkpoint.enable", "true",
                    "--checkpoint.interval", "6", *MLA, *SIGMOID, "--model.q_lora_rank", "16")
        self.assertNotEqual(gqa.returncode, 0)
        self.assertIn("has no tensor 'layers.0.attention.q_a.weight'", gqa.stderr)
        self.assertIn("MLA (q rank 0, kv rank 32)", gqa.stderr)
        self.assertIn("MLA (q rank 16, kv rank 32)", gqa.stderr)

    def test_routing_bias_update_balances_the_load(self):
        def imbalance(rate):
            run_dir = os.path.join(scratch_dir(), f"rate-{rate}")
            result = forge("train", *MLA, *SIGMOID, "--model.router_bias_update_rate", str(rate), "--training.steps",
                           "80", "--eval.interval", "0", "--logging.run_dir", run_dir)
            self.assertEqual(result.returncode, 0, result.stderr)
            late = [r["expert_load_max_over_mean"] for r in records(run_dir, "train")[-30:]]
            return sum(late) / len(late)
        fixed, updated = imbalance(0), imbalance(0.02)
        print(f"load max/mean over the last 30 of 80 steps: biases fixed {fixed:.3f}, updated {updated:.3f}")
        self.assertLess(updated, fixed)

    def test_info_counts_deepseek_v2_lite(self):
        info = forge("info", "deepseek-v2-lite")
        self.assertEqual(info.returncode, 0, info.stderr)
        self.assertIn("15.71 B (15706484224 total", info.stdout)
        self.assertIn("64 experts of ffn 1408, top-6 (softmax scores) + 2 shared, the first 1 blocks dense", info.stdout)


if __name__ == "__main__":
    unittest.main()
