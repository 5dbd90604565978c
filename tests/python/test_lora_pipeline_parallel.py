"""LoRA and QLoRA under pipeline parallelism across real CPU processes (forge launch, the CPU
process group; NOTE [LoRA under pipeline parallelism] in model/lora.h), from a Hugging Face
Llama of 4 blocks: 2 pipeline ranks under 1F1B and under the interleaved schedule (2 stages
of one block per rank) give the single-process run's losses, gradient norms, PEFT adapter
(the same tensor names and shapes, the values within fp32 reordering) and merged export on
the same global batch; so does QLoRA (each rank quantizes its stages' projections alone),
and so does a run with adapter dropout (each micro-batch's masks are one process's, however
the schedule orders the micro-batches). A pipeline run resumes bitwise from its checkpoint,
its checkpoint resumes on one process and a one-process checkpoint on 2 pipeline ranks; the
keys LoRA under pipelining cannot take yet are refused by name."""
import os
import shutil
import subprocess
import unittest

import numpy as np
import torch
from safetensors.torch import load_file

from hf_tiny import DEBUG_TINY, random_model
from forge_test_util import forge_bin, records, relative_error, run, scratch_dir, train_losses

GLOBAL_BATCH = 8
TIMEOUT = 300
# One process against several: fp32 sums in another order.
LOSS_TOLERANCE = 1e-5
# Adapters after 6 AdamW steps: the update divides by sqrt(v), which magnifies the reordering
# of near-zero gradient entries (B starts at zero); as tests/python/test_lora_parallel.py.
ADAPTER_TOLERANCE = 1e-4
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
QLORA = ["--lora.quantize_base", "nf4"]
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]


class LoraPipelineParallel(unittest.TestCase):
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
        cls.single = cls.train("single", 1)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    @classmethod
    def train(cls, name, ranks, *extra, steps=6, export=True):
        """LoRA (rank 4, all-linear) on the HF base for `steps` steps on RANKS CPU ranks, micro-batch
        2 and 4 micro-batches (the global batch of 8 sequences), selective checkpointing; export:
        the merged model in fp32."""
        run_dir = os.path.join(cls.work, name)
        args = ["train", "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", cls.base,
                "--activation_checkpoint.mode", "selective", "--training.local_batch_size", "2",
                "--training.gradient_accumulation_steps", str(GLOBAL_BATCH // 2),
                "--training.seq_len", "32", "--training.steps", str(steps), "--eval.interval", "3",
                "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "8", "--logging.run_dir", run_dir,
                "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "all-linear", *extra]
        if export:
            args += ["--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "fp32"]
        command = [forge_bin(), *args] if ranks == 1 else [forge_bin(), "launch", "--nproc-per-node", str(ranks),
                                                           "--", *args]
        cls.last = run(command, timeout=TIMEOUT, env=dict(os.environ, FORGE_NUM_THREADS="1"))
        return run_dir

    def adapters(self, run_dir):
        return load_file(os.path.join(run_dir, "adapter", "adapter_model.safetensors"))

    def assert_follows(self, run_dir, single, export=True):
        losses, reference = train_losses(run_dir), train_losses(single)
        self.assertEqual(len(losses), 6)
        self.assertLess(relative_error(np.array(losses), np.array(reference)), LOSS_TOLERANCE)
        norms = [r["grad_norm"] for r in records(run_dir)]
        self.assertLess(relative_error(np.array(norms), np.array([r["grad_norm"] for r in records(single)])),
                        LOSS_TOLERANCE)
        evals = [r["loss"] for r in records(run_dir, "eval")]
        self.assertEqual(len(evals), 2)
        self.assertLess(relative_error(np.array(evals), np.array([r["loss"] for r in records(single, "eval")])),
                        LOSS_TOLERANCE)
        mine, theirs = self.adapters(run_dir), self.adapters(single)
        self.assertEqual(sorted(mine), sorted(theirs), "the PEFT adapter's tensors")
        for name in theirs:
            self.assertEqual(mine[name].shape, theirs[name].shape, name)
            self.assertLess(relative_error(mine[name].numpy(), theirs[name].numpy()), ADAPTER_TOLERANCE, name)
        self.assertTrue(any(float(t.abs().max()) > 0 for n, t in mine.items() if "lora_B" in n), "B did not train")
        for layer in range(4):  # every stage's adapters trained and reached rank 0's file
            self.assertGreater(float(mine[f"base_model.model.model.layers.{layer}.mlp.down_proj.lora_B.weight"]
                                     .abs().max()), 0, layer)
        with open(os.path.join(run_dir, "adapter", "adapter_config.json")) as f, \
                open(os.path.join(single, "adapter", "adapter_config.json")) as g:
            self.assertEqual(f.read(), g.read())
        if not export:
            return
        merged = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
        reference_merged = load_file(os.path.join(single, "hf", "model.safetensors"))
        self.assertEqual(sorted(merged), sorted(reference_merged))
        for name in reference_merged:
            self.assertLess(relative_error(merged[name].numpy(), reference_merged[name].numpy()), ADAPTER_TOLERANCE,
                            name)

    def test_pipeline_ranks_follow_one_process(self):
        for name, flags in (("pp2", PP2), ("pp2-interleaved", PP2 + INTERLEAVED)):
            with self.subTest(run=name):
                run_dir = self.train(name, 2, *flags)
                self.assertIn("pipeline rank 0 of 2", self.last.stdout + self.last.stderr)
                self.assert_follows(run_dir, self.single)

    def test_qlora_under_pipeline_parallelism_follows_one_process(self):
        single = self.train("qlora1", 1, *QLORA)
        for name, flags in (("qlora-pp2", PP2), ("qlora-pp2-interleaved", PP2 + INTERLEAVED)):
            with self.subTest(run=name):
                self.assert_follows(self.train(name, 2, *flags, *QLORA), single)

    def test_dropout_masks_are_one_processes(self):
        dropout = ["--lora.dropout", "0.1"]
        single = self.train("dropout1", 1, *dropout, export=False)
        self.assertNotEqual(train_losses(single)[1:], train_losses(self.single)[1:], "the dropout changed the steps")
        for name, flags in (("dropout-pp2", PP2), ("dropout-pp2-interleaved", PP2 + INTERLEAVED)):
            with self.subTest(run=name):
                self.assert_follows(self.train(name, 2, *flags, *dropout, export=False), single, export=False)

    def test_resume_is_bitwise_and_crosses_layouts(self):
        dropout = ["--lora.dropout", "0.1"]
        straight = self.train("ckpt-straight", 2, *PP2, *SAVE, *dropout, export=False)
        resumed = self.train("ckpt-resumed", 2, *PP2, *SAVE, *dropout, steps=3, export=False)
        self.train("ckpt-resumed", 2, *PP2, *SAVE, *dropout, export=False)
        self.assertIn("resuming from checkpoint", self.last.stdout + self.last.stderr)
        self.assertEqual(train_losses(straight), train_losses(resumed))
        for name, tensor in self.adapters(straight).items():
            self.assertTrue(bool((tensor == self.adapters(resumed)[name]).all()), name)
        single = self.train("ckpt-single", 1, *SAVE, *dropout, export=False)
        for name, ranks, flags, source, reference in (
                ("pp2-then-one", 1, [], straight, straight),
                ("pp2-then-interleaved", 2, PP2 + INTERLEAVED, straight, straight),
                ("one-then-pp2", 2, PP2, single, single)):
            with self.subTest(layout=name):
                saved = os.path.join(self.work, f"{name}-checkpoints")
                shutil.copytree(os.path.join(source, "checkpoints"), saved)
                tail = self.train(name, ranks, *flags, "--checkpoint.enable", "true", "--checkpoint.folder", saved,
                                  "--checkpoint.load_step", "3", *dropout, export=False)
                self.assertIn("resuming from checkpoint", self.last.stdout + self.last.stderr)
                self.assertLess(relative_error(np.array(train_losses(tail)), np.array(train_losses(reference)[3:])),
                                LOSS_TOLERANCE)


class Errors(unittest.TestCase):
    def test_what_cannot_be_combined_is_named(self):
        lora = ["--lora.rank", "4", "--model.num_layers", "4", *PP2]
        runs_alone = "yet: LoRA under pipeline parallelism runs on pipeline ranks alone"
        for ranks, flags, words in (
                (4, lora + ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.zero_stage", "1"],
                 ["with lora.rank = 4", "cannot be combined with parallelism.data_parallel_shard_degree = 2",
                  runs_alone]),
                (4, lora + ["--parallelism.tensor_parallel_degree", "2"],
                 ["cannot be combined with parallelism.tensor_parallel_degree = 2", runs_alone]),
                (4, lora + ["--parallelism.context_parallel_degree", "2", "--parallelism.zero_stage", "1"],
                 ["cannot be combined with parallelism.context_parallel_degree = 2", runs_alone]),
                (2, lora + ["--precision.fp8", "tensorwise"],
                 ["cannot be combined with precision.fp8 = tensorwise",
                  "yet: LoRA's FP8 frozen base is not cut into stages"])):
            with self.subTest(flags=flags):
                result = subprocess.run([forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", "train",
                                         "--training.steps", "1", "--logging.run_dir",
                                         os.path.join(scratch_dir(), "refused"), *flags],
                                        capture_output=True, text=True, timeout=TIMEOUT,
                                        env=dict(os.environ, FORGE_NUM_THREADS="1"))
                self.assertNotEqual(result.returncode, 0)
                for word in words:
                    self.assertIn(word, result.stdout + result.stderr)


if __name__ == "__main__":
    unittest.main()
