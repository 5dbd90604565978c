"""QLoRA with the NF4 base's GEMMs in FP8 (precision.fp8 with lora.quantize_base nf4; NOTE
[FP8 over an NF4 base] in src/model/nf4_base.cpp) on the CPU reference, from a Hugging Face
Llama of 4 blocks: one process follows QLoRA without FP8 (tensorwise and delayed); 2
data-parallel ranks (the NF4 base replicated), 2 pipeline ranks (each quantizing and casting
its stages' projections alone; and with 2 data-parallel ranks per stage) and 2 context-parallel ranks follow one process's QLoRA FP8
run on the same global batch; a delayed run resumes bitwise from its checkpoint (the base
quantized again at import, the amax histories from the checkpoint); forge info says how the
base's weights are cast.

Tolerances. Against QLoRA without FP8: FP8 rounds the base GEMMs' operands to E4M3 (x, W)
and E5M2 (dy) (the adapters stay in fp32 here), a perturbation of a few percent per GEMM
that training averages out, as LoRA's FP8 run against fp32 LoRA (tests/python/
test_fp8_training.py): the same bounds, every step within 2% and the mean within 0.5%.
Measured over 20 steps (loss 3.67 -> 3.07): tensorwise within 0.61% (mean 0.11%), delayed
within 0.83% (mean 0.23%).
Ranks against one process: data and pipeline parallelism cast the same tensors as one
process (each micro-batch's x and dy, the whole W; the delayed amaxes max-reduced over the
ranks), so only fp32 reordering differs, which Adam amplifies where a gradient is near zero
and FP8 casts can turn into a code's step where a value sits near a boundary. Measured over
6 steps: 2 data-parallel ranks (whose gradient all-reduce sums in another order) 5.7e-4
(tensorwise) and 4.5e-4 (delayed); 2 pipeline ranks (the same sums) 3.5e-8 and 3.0e-8, and
with 2 data-parallel ranks per stage the data-parallel runs' 5.7e-4 and 4.5e-4; the bound is
2e-3. Context-parallel ranks scale their chunks' activations by their own amaxes
(NOTE [FP8 under context and pipeline parallelism]): measured 8.9e-4 and 1.4e-3, the bound
1e-2 as LoRA's (test_lora_parallel.py's LoraFp8ContextParallel). The values are printed."""
import os
import shutil
import unittest

import torch

from hf_tiny import DEBUG_TINY, random_model
from forge_test_util import forge_bin, run, scratch_dir, train_losses

GLOBAL_BATCH = 8
TIMEOUT = 300
QLORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "all-linear", "--lora.quantize_base",
         "nf4"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]


def relative_differences(curve, reference):
    return [abs(a - b) / abs(b) for a, b in zip(curve, reference)]


class QloraFp8(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = scratch_dir()
        cls.base = os.path.join(cls.work, "base")
        model = random_model("llama", dict(DEBUG_TINY, num_hidden_layers=4), seed=7)
        with torch.no_grad():  # matrices N(0, 0.06): a model whose training is not chaotic
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(0.2)
        model.save_pretrained(cls.base)
        cls.one = {}  # recipe: one process's QLoRA FP8 losses over 6 steps

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    @classmethod
    def train(cls, name, ranks, *extra, steps=6, data_ranks=1):
        """QLoRA (rank 4, all-linear) on the HF base for `steps` steps on RANKS CPU ranks, micro-batch
        2 and the micro-batches over DATA_RANKS data-parallel ranks that fill the global batch of
        8 sequences, selective checkpointing."""
        run_dir = os.path.join(cls.work, name)
        args = ["train", "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", cls.base,
                "--activation_checkpoint.mode", "selective", "--training.local_batch_size", "2",
                "--training.gradient_accumulation_steps", str(GLOBAL_BATCH // (2 * data_ranks)),
                "--training.seq_len", "32", "--training.steps", str(steps), "--eval.interval", "0",
                "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "20", "--optimizer.lr", "0.01",
                "--logging.run_dir", run_dir, *QLORA, *extra]
        command = [forge_bin(), *args] if ranks == 1 else \
            [forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", *args]
        cls.last = run(command, timeout=TIMEOUT, env=dict(os.environ, FORGE_NUM_THREADS="1"))
        return run_dir

    def test_follows_qlora_without_fp8(self):
        plain = train_losses(self.train("plain", 1, steps=20))
        for recipe in ("tensorwise", "delayed"):
            with self.subTest(recipe=recipe):
                losses = train_losses(self.train("fp8-" + recipe, 1, "--precision.fp8", recipe, steps=20))
                self.assertIn("NF4 base's (each dequantized to bf16, then cast)", self.last.stdout + self.last.stderr)
                self.assertEqual(len(losses), 20)
                differences = relative_differences(losses, plain)
                print(f"QLoRA FP8 {recipe} vs QLoRA over 20 steps: max {max(differences):.3g}, "
                      f"mean {sum(differences) / len(differences):.3g} (loss {plain[0]:.4f} -> {plain[-1]:.4f})")
                self.assertLess(max(differences), 0.02, differences)
                self.assertLess(sum(differences) / len(differences), 0.005, differences)
                self.assertNotEqual(losses, plain)  # FP8 did run
                self.assertLess(losses[-1], 0.95 * losses[0])

    def assert_ranks_follow(self, name, ranks, flags, tolerance, data_ranks=1):
        for recipe in ("tensorwise", "delayed"):
            with self.subTest(run=name, recipe=recipe):
                fp8 = ["--precision.fp8", recipe]
                if recipe not in self.one:
                    self.one[recipe] = train_losses(self.train(f"one-{recipe}", 1, *fp8))
                one = self.one[recipe]
                losses = train_losses(self.train(f"{name}-{recipe}", ranks, *fp8, *flags, data_ranks=data_ranks))
                self.assertEqual(len(losses), 6)
                differences = relative_differences(losses, one)
                print(f"QLoRA FP8 {recipe} on {name} vs one process over 6 steps: max {max(differences):.3g}")
                self.assertLess(max(differences), tolerance, differences)

    def test_data_parallel_ranks_follow_one(self):
        self.assert_ranks_follow("dp2", 2, ["--parallelism.data_parallel_shard_degree", "2"], 2e-3, data_ranks=2)
        self.assertIn("QLoRA: the NF4 base and the LoRA adapters", self.last.stdout + self.last.stderr)

    def test_pipeline_ranks_follow_one(self):
        self.assert_ranks_follow("pp2", 2, ["--parallelism.pipeline_parallel_degree", "2"], 2e-3)
        # With 2 data-parallel ranks per stage (the NF4 base replicated over them).
        self.assert_ranks_follow("pp2-dp2", 4, ["--parallelism.pipeline_parallel_degree", "2",
                                                "--parallelism.data_parallel_shard_degree", "2"], 2e-3, data_ranks=2)

    def test_context_parallel_ranks_follow_one(self):
        self.assert_ranks_follow("cp2", 2, ["--parallelism.context_parallel_degree", "2"], 1e-2)

    def test_delayed_resume_is_exact(self):
        delayed = ["--precision.fp8", "delayed", "--precision.fp8_amax_history_len", "8", "--lora.dropout", "0.1",
                   *SAVE]
        full = self.train("delayed-full", 1, *delayed)
        self.train("delayed-resumed", 1, *delayed, steps=3)
        resumed = self.train("delayed-resumed", 1, *delayed)
        self.assertIn("resuming from checkpoint", self.last.stdout + self.last.stderr)
        self.assertEqual(train_losses(resumed), train_losses(full))

    def test_info_says_how_the_base_is_cast(self):
        result = run([forge_bin(), "info", "llama3.1-8b", "--lora.rank", "16", "--lora.quantize_base", "nf4",
                      "--precision.fp8", "tensorwise", "--training.device", "cuda"], timeout=TIMEOUT)
        self.assertIn("forward and input-gradient GEMMs of the frozen", result.stdout)
        self.assertIn("in every GEMM from the NF4 codes (on CUDA straight to E4M3", result.stdout)
        # The estimate: QLoRA's NF4 base and the FP8 scratch, no cache of the base's FP8 codes.
        self.assertIn("frozen NF4 projections", result.stdout)
        self.assertIn("FP8 GEMM scratch", result.stdout)
        self.assertNotIn("FP8 weight cache", result.stdout)


if __name__ == "__main__":
    unittest.main()
