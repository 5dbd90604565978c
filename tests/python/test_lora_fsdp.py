"""LoRA under data parallelism across real CPU processes (forge launch), from a Hugging Face
Llama, with activation checkpointing: 2 ranks (shard 2) and 4 ranks (shard 2 x replicate 2)
give the losses, the final adapters and the merged export of the single-process run on the
same global batch (within fp32 reordering: the adapter gradients are summed over the ranks
in another order than one process accumulates them); so does QLoRA, its NF4 base
replicated on every rank; a run resumed under data parallelism gives bitwise the losses and
adapters of the uninterrupted data-parallel run (LoRA and QLoRA); every rank holds half of
the frozen base. (Full fine-tuning's import under FSDP, one parameter at a time like the
frozen base's, is checked here too.)"""
import json
import os
import shutil
import subprocess
import unittest

import numpy as np
import torch
from safetensors.torch import load_file

from hf_tiny import DEBUG_TINY, random_model
from forge_test_util import forge_bin, relative_error, run, scratch_dir, train_losses

GLOBAL_BATCH = 8
TIMEOUT = 300
# A data-parallel run against one process: fp32 sums in another order.
LOSS_TOLERANCE = 1e-5
# Adapters after 6 AdamW steps: the update divides by sqrt(v), which magnifies the reordering
# of near-zero gradient entries (B starts at zero).
ADAPTER_TOLERANCE = 1e-4


class LoraDataParallel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = scratch_dir()
        cls.base = os.path.join(cls.work, "base")
        random_model("llama", DEBUG_TINY, seed=7).save_pretrained(cls.base)
        cls.single = cls.train("single", 1, 1)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    @classmethod
    def train(cls, name, shards, replicas, *extra, steps=6, export=True, lora=True):
        run_dir = os.path.join(cls.work, name)
        command = cls.command(run_dir, shards, replicas, *extra, steps=steps, export=export, lora=lora)
        cls.last = run(command, timeout=TIMEOUT, env=dict(os.environ, FORGE_NUM_THREADS="1"))
        return run_dir

    @classmethod
    def command(cls, run_dir, shards, replicas, *extra, steps=6, export=True, lora=True):
        """LoRA on the HF base for `steps` steps on shards x replicas CPU ranks, micro-batch 2,
        accumulation filling the global batch of 8 sequences, full activation checkpointing;
        export: the merged model into <run_dir>/hf; lora False: full fine-tuning."""
        ranks = shards * replicas
        args = ["train", "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path", cls.base,
                "--activation_checkpoint.mode", "full", "--training.local_batch_size", "2",
                "--training.gradient_accumulation_steps", str(GLOBAL_BATCH // (2 * ranks)), "--training.seq_len", "32",
                "--training.steps", str(steps), "--eval.interval", "0", "--lr_scheduler.warmup_steps", "2",
                "--lr_scheduler.decay_steps", "8", "--logging.run_dir", run_dir,
                "--parallelism.data_parallel_shard_degree", str(shards),
                "--parallelism.data_parallel_replicate_degree", str(replicas), *extra]
        if lora:
            args += ["--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "all-linear"]
        if export:
            args += ["--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "fp32"]
        if ranks == 1:
            return [forge_bin(), *args]
        return [forge_bin(), "launch", "--nproc-per-node", str(ranks), "--", *args]

    def adapters(self, run_dir):
        return load_file(os.path.join(run_dir, "adapter", "adapter_model.safetensors"))

    def assert_follows_single(self, run_dir):
        losses, reference = train_losses(run_dir), train_losses(self.single)
        self.assertEqual(len(losses), 6)
        self.assertLess(relative_error(np.array(losses), np.array(reference)), LOSS_TOLERANCE)
        mine, theirs = self.adapters(run_dir), self.adapters(self.single)
        self.assertEqual(sorted(mine), sorted(theirs))
        for name in theirs:
            self.assertLess(relative_error(mine[name].numpy(), theirs[name].numpy()), ADAPTER_TOLERANCE, name)
        self.assertTrue(any(float(t.abs().max()) > 0 for n, t in mine.items() if "lora_B" in n), "B did not train")
        merged = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
        reference_merged = load_file(os.path.join(self.single, "hf", "model.safetensors"))
        for name in reference_merged:
            self.assertLess(relative_error(merged[name].numpy(), reference_merged[name].numpy()), ADAPTER_TOLERANCE,
                            name)
        base = load_file(os.path.join(self.base, "model.safetensors"))
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.input_layernorm.weight"):
            self.assertTrue(torch.equal(base[name], merged[name]), f"{name}: the frozen base, bit for bit")

    def test_two_ranks_follow_one_process(self):
        run_dir = self.train("ranks2", 2, 1)
        log = self.last.stdout + self.last.stderr
        for rank in (0, 1):
            self.assertRegex(log, rf"\[rank {rank}\] fsdp rank {rank} of 2 \(ZeRO-3.*LoRA: frozen base chunk .* = "
                                  r"1/1\.9\d\d of the base's")
        self.assert_follows_single(run_dir)

    def test_hybrid_four_ranks_follow_one_process(self):
        self.assert_follows_single(self.train("hybrid", 2, 2))

    def test_zero_one_keeps_the_base_whole_and_follows_one_process(self):
        self.assert_follows_single(self.train("zero1", 2, 1, "--parallelism.zero_stage", "1"))

    def test_resume_under_data_parallelism_is_bitwise(self):
        for kind, extra in (("lora", []), ("qlora", ["--lora.quantize_base", "nf4"])):
            with self.subTest(kind):
                common = ["--lora.dropout", "0.1", "--checkpoint.enable", "true", "--checkpoint.interval", "3", *extra]
                straight = self.train(f"{kind}-straight", 2, 1, *common, export=False)
                resumed = self.train(f"{kind}-resumed", 2, 1, *common, steps=3, export=False)
                with open(os.path.join(resumed, "checkpoints", "step-3", "metadata.json")) as f:
                    metadata = json.load(f)
                self.assertEqual(len(metadata["shards"]), 1, "the replicated adapters are saved once")
                self.assertFalse(any(t["name"].endswith(".weight") for t in metadata["tensors"]), "adapters only")
                self.train(f"{kind}-resumed", 2, 1, *common, export=False)
                self.assertIn("resuming from checkpoint", self.last.stdout + self.last.stderr)
                self.assertEqual(train_losses(straight), train_losses(resumed))
                first, second = self.adapters(straight), self.adapters(resumed)
                for name in first:
                    self.assertTrue(torch.equal(first[name], second[name]), name)

    def test_full_fine_tune_imports_the_same_weights_on_two_ranks(self):
        single = self.train("full1", 1, 1, steps=2, export=False, lora=False)
        double = self.train("full2", 2, 1, steps=2, export=False, lora=False)
        self.assertLess(relative_error(np.array(train_losses(double)), np.array(train_losses(single))), LOSS_TOLERANCE)

    def test_a_non_finite_adapter_gradient_is_named(self):
        command = self.command(os.path.join(self.work, "nan"), 2, 1, steps=3, export=False)
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT,
                                env=dict(os.environ, FORGE_NUM_THREADS="1",
                                         FORGE_TEST_INJECT_NAN="2:layers.1.attention.qkv.lora_b:1"))
        self.assertNotEqual(result.returncode, 0)
        # Every rank finds the same; one may hear of the other's failure first and stop on that.
        self.assertRegex(result.stdout + result.stderr,
                         r"\[rank [01]\] error: non-finite step 2 .*accumulation step 1 of 2 .*first non-finite "
                         r"gradient \(in parameter order\) is 'layers\.1\.attention\.qkv\.lora_b'")

    def test_qlora_replicates_its_nf4_base_and_follows_one_process(self):
        qlora = ["--lora.quantize_base", "nf4"]
        single = self.train("qlora1", 1, 1, *qlora)
        for name, shards, replicas in (("qlora2", 2, 1), ("qlora4", 2, 2)):
            with self.subTest(name):
                run_dir = self.train(name, shards, replicas, *qlora)
                self.assertIn("QLoRA: the NF4 base and the LoRA adapters", self.last.stdout + self.last.stderr)
                self.assertLess(relative_error(np.array(train_losses(run_dir)), np.array(train_losses(single))),
                                LOSS_TOLERANCE)
                mine, theirs = self.adapters(run_dir), self.adapters(single)
                for tensor in theirs:
                    self.assertLess(relative_error(mine[tensor].numpy(), theirs[tensor].numpy()), ADAPTER_TOLERANCE,
                                    tensor)
                merged = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
                reference = load_file(os.path.join(single, "hf", "model.safetensors"))
                for tensor in reference:
                    self.assertLess(relative_error(merged[tensor].numpy(), reference[tensor].numpy()),
                                    ADAPTER_TOLERANCE, tensor)


    def test_forge_info_sizes_a_rank(self):
        def info(*extra):
            return run([forge_bin(), "info", "debug-tiny", "--lora.rank", "4",
                        "--parallelism.data_parallel_shard_degree", "4", *extra]).stdout
        self.assertIn("per rank of FSDP ZeRO-3 over 4 shard ranks", info())
        self.assertRegex(info(), r"frozen fp32 weights .* \+ LoRA adapters")
        self.assertIn("per rank of 4 data-parallel ranks (the NF4 base and the adapters replicated)",
                      info("--lora.quantize_base", "nf4"))


if __name__ == "__main__":
    unittest.main()
