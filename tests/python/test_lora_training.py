"""forge train with LoRA, end to end, from a Hugging Face Llama: the adapters train while
the base stays frozen; the run directory's PEFT adapter (peft.PeftModel.from_pretrained)
and the merged Hugging Face export compute the same function; a run resumed from a LoRA
checkpoint (adapters + their AdamW state only) gives bitwise the losses of the
uninterrupted run, adapter dropout included; a run continues from a PEFT adapter
(lora.adapter_path) and refuses one that does not match."""
import json
import os
import shutil
import subprocess
import unittest

import numpy as np
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_tiny import DEBUG_TINY, random_model
from forge_test_util import forge_bin, relative_error, run, scratch_dir, train_losses

SCHEDULE = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "8", "--eval.interval", "0"]


class LoraTraining(unittest.TestCase):
    def setUp(self):
        self.work = scratch_dir()
        self.addCleanup(shutil.rmtree, self.work, ignore_errors=True)
        self.base = os.path.join(self.work, "base")
        random_model("llama", DEBUG_TINY, seed=5).save_pretrained(self.base)

    def command(self, run_dir, *extra):
        return [forge_bin(), "train", "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path",
                self.base, "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "all-linear",
                "--training.local_batch_size", "2", "--training.seq_len", "32", "--logging.run_dir", run_dir,
                *SCHEDULE, *extra]

    def train(self, run_dir, *extra):
        return run(self.command(run_dir, *extra))

    def hf_model(self, path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()

    def test_adapters_train_and_export_as_peft_and_merged(self):
        run_dir = os.path.join(self.work, "run")
        out = self.train(run_dir, "--training.steps", "4", "--checkpoint.last_save_in_hf", "true")
        self.assertIn("trainable parameters", out.stderr + out.stdout)
        with open(os.path.join(run_dir, "adapter", "adapter_config.json")) as f:
            config = json.load(f)
        self.assertEqual((config["peft_type"], config["r"], config["lora_alpha"]), ("LORA", 4, 8.0))
        adapter = load_file(os.path.join(run_dir, "adapter", "adapter_model.safetensors"))
        self.assertEqual(len(adapter), 2 * 7 * 2)  # A and B of 7 modules in 2 layers
        self.assertTrue(any(float(t.abs().max()) > 0 for n, t in adapter.items() if "lora_B" in n), "B did not train")

        tokens = torch.from_numpy(np.random.RandomState(2).randint(0, 32, size=(2, 13)))
        peft = PeftModel.from_pretrained(self.hf_model(self.base), os.path.join(run_dir, "adapter")).eval()
        merged = self.hf_model(os.path.join(run_dir, "hf"))
        with torch.no_grad():
            a, b = peft(input_ids=tokens).logits.numpy(), merged(input_ids=tokens).logits.numpy()
        self.assertLess(relative_error(b, a), 1e-5, "merged export against the PEFT adapter on the base")

        # Frozen: what no adapter touches is the base, bit for bit.
        base = load_file(os.path.join(self.base, "model.safetensors"))
        exported = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                     "model.layers.1.input_layernorm.weight"):
            self.assertTrue(torch.equal(base[name], exported[name]), name)

    def test_resume_from_a_lora_checkpoint_is_bitwise(self):
        common = ["--lora.dropout", "0.1", "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
        straight = os.path.join(self.work, "straight")
        self.train(straight, "--training.steps", "6", *common)
        resumed = os.path.join(self.work, "resumed")
        self.train(resumed, "--training.steps", "3", *common)
        with open(os.path.join(resumed, "checkpoints", "step-3", "metadata.json")) as f:
            names = {t["name"] for t in json.load(f)["tensors"]}
        self.assertIn("layers.0.attention.qkv.lora_a", names)
        self.assertFalse(any(n.endswith(".weight") for n in names), "a LoRA checkpoint holds the adapters only")
        out = self.train(resumed, "--training.steps", "6", *common)
        self.assertNotIn("the checkpoint's adapters were trained with", out.stdout + out.stderr)
        self.assertEqual(train_losses(straight), train_losses(resumed))
        self.assertEqual(len(train_losses(straight)), 6)

        # Another alpha or dropout continues the adapters, and says so.
        out = self.train(resumed, "--training.steps", "7", "--lora.alpha", "4", "--lora.dropout", "0.2",
                         *common[2:])
        said = out.stdout + out.stderr
        self.assertIn("trained with lora.alpha 8, this run has 4", said)
        self.assertIn("trained with lora.dropout 0.1, this run has 0.2", said)

    def test_continues_from_a_peft_adapter_and_refuses_a_mismatch(self):
        first = os.path.join(self.work, "first")
        self.train(first, "--training.steps", "2")
        adapter = os.path.join(first, "adapter")
        second = os.path.join(self.work, "second")
        out = self.train(second, "--training.steps", "1", "--lora.adapter_path", adapter, "--optimizer.lr", "1e-30")
        self.assertIn("LoRA adapters from the PEFT adapter", out.stderr + out.stdout)
        before = load_file(os.path.join(adapter, "adapter_model.safetensors"))
        after = load_file(os.path.join(second, "adapter", "adapter_model.safetensors"))
        for name in before:
            self.assertTrue(torch.equal(before[name], after[name]), name)

        refused = subprocess.run(self.command(os.path.join(self.work, "third"), "--lora.rank", "8",
                                              "--lora.adapter_path", adapter), capture_output=True, text=True)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("adapter_config.json: r is 4, but lora.rank is 8", refused.stderr)

    def test_bad_settings_are_refused_naming_the_key(self):
        for extra, message in [
            (["--lora.target_modules", "q_proj,qkv"], "'qkv' is not a module of the decoder"),
            (["--lora.dropout", "1"], "lora.dropout expects a number in [0, 1)"),
        ]:
            result = subprocess.run(self.command(os.path.join(self.work, "bad"), *extra), capture_output=True,
                                    text=True)
            self.assertNotEqual(result.returncode, 0, extra)
            self.assertIn(message, result.stderr, extra)


if __name__ == "__main__":
    unittest.main()
