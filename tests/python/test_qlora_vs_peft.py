"""forge's QLoRA (lora.quantize_base nf4, NOTE [QLoRA base]) against transformers + PEFT on a
tiny Hugging Face Llama whose seven projections per block are replaced by bitsandbytes'
dequantize_4bit(quantize_4bit(W, nf4, blocksize=64, compress_statistics=True)) (its CPU
backend), as a bitsandbytes 4-bit model computes: forge imports the unquantized model and
quantizes it itself;
  - with a PEFT adapter loaded, forge's logits and adapter gradients equal PEFT's (float64)
    within 1e-4 relative;
  - the adapter forge saves loads into PEFT on that dequantized base with the same logits;
  - forge's merged export equals PEFT's merge_and_unload() on the dequantized base;
on a Mixtral and DeepSeek-V2/V3, the routed experts quantized too, one NF4 tensor per expert
matrix, and MLA's rotary rows in their published order, the same against PEFT on the model so
dequantized (QloraMoeVsPeft);
and `forge train` with lora.quantize_base nf4 end to end: the adapters train, the PEFT
adapter and the merged export agree, a resumed run is bitwise the uninterrupted one (the
base is quantized again at import), resuming QLoRA adapters on an unquantized base warns,
and QLoRA without adapters or a Hugging Face import is refused."""
import json
import os
import shutil
import subprocess
import unittest

import bitsandbytes.functional as BF
import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_tiny import ROPE, random_model
from forge_test_util import forge_bin, relative_error, run, scratch_dir, tool, train_losses

TOLERANCE = 1e-4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nf4_roundtrip(w):
    """What a bitsandbytes Linear4bit (nf4, double quant) computes with, in fp32."""
    packed, state = BF.quantize_4bit(w.float().contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4")
    # Dequantized as one row: bitsandbytes' AVX-512 kernel takes a row's blocks to start at the
    # row when in_features is a multiple of 16 but not of 64 (tests/python/test_nf4_vs_bitsandbytes.py).
    state.shape = torch.Size([w.numel()])
    state.dtype = torch.float32
    return BF.dequantize_4bit(packed, state).reshape(w.shape)


def base_model(seed, tied):
    return random_model("llama", dict(vocab_size=53, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, tie_word_embeddings=tied, rope_parameters=ROPE), seed)


def dequantized_copy(model):
    """The model with every block projection replaced by its NF4 round trip."""
    copy = LlamaForCausalLM(model.config).float().eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if any(f".{m}." in name for m in PROJECTIONS):
                p.copy_(nf4_roundtrip(p))
    return copy


class QloraVsPeft(unittest.TestCase):
    def check(self, rank, alpha, targets, tied):
        work = scratch_dir()
        self.addCleanup(shutil.rmtree, work, ignore_errors=True)
        model = base_model(seed=rank * 7 + len(targets), tied=tied)
        model.save_pretrained(os.path.join(work, "base"))
        dequantized = dequantized_copy(model)
        dequantized.save_pretrained(os.path.join(work, "dequantized"))
        target_list = "all-linear" if targets == "all-linear" else targets.split(",")
        peft = get_peft_model(dequantized, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                      target_modules=target_list, task_type="CAUSAL_LM"))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.4)
        peft.save_pretrained(os.path.join(work, "peft_adapter"))
        b, s = 2, 9
        tokens = torch.randint(0, 53, (b, s), dtype=torch.int32)
        labels = torch.randint(0, 53, (b, s), dtype=torch.int32)
        tokens.numpy().tofile(os.path.join(work, "tokens.bin"))
        labels.numpy().tofile(os.path.join(work, "targets.bin"))
        with open(os.path.join(work, "lora.json"), "w") as f:
            json.dump(dict(rank=rank, alpha=alpha, target_modules=targets, batch=b, seq_len=s, quantize_base="nf4"), f)
        run([tool("forge_lora_reference"), work])

        peft = peft.double()
        peft.zero_grad()
        logits = peft(input_ids=tokens.long()).logits
        loss = F.cross_entropy(logits.reshape(b * s, -1), labels.reshape(-1).long())
        loss.backward()
        ref = logits.detach().reshape(b * s, -1).numpy()
        mine = np.fromfile(os.path.join(work, "logits.bin"), dtype=np.float32).reshape(b * s, -1)
        err = relative_error(mine.astype(np.float64), ref)
        print(f"r{rank} {targets} tied={tied}: logits rel err {err:.2e}")
        self.assertLess(err, TOLERANCE, "QLoRA logits")
        ref_grads = {n.replace(".default", ""): p.grad for n, p in peft.named_parameters() if "lora_" in n}
        forge_grads = load_file(os.path.join(work, "forge_grads", "adapter_model.safetensors"))
        self.assertEqual(sorted(forge_grads), sorted(ref_grads))
        for name, g in ref_grads.items():
            self.assertLess(relative_error(forge_grads[name].double().numpy(), g.numpy()), TOLERANCE, name)

        # forge's adapter in PEFT, on the dequantized base
        base = AutoModelForCausalLM.from_pretrained(os.path.join(work, "dequantized"), dtype=torch.float64,
                                                    attn_implementation="eager")
        loaded = PeftModel.from_pretrained(base, os.path.join(work, "forge_adapter")).eval()
        with torch.no_grad():
            again = loaded(input_ids=tokens.long()).logits.reshape(b * s, -1).numpy()
        self.assertLess(relative_error(again, ref), 1e-10, "forge's QLoRA adapter in PEFT")

        merged = peft.merge_and_unload().state_dict()
        exported = load_file(os.path.join(work, "merged", "model.safetensors"))
        for name, t in exported.items():
            self.assertLess(relative_error(t.double().numpy(), merged[name].numpy()), 1e-6, f"merged {name}")

    def test_cases(self):
        for rank, alpha, targets, tied in [(4, 8.0, "all-linear", False), (2, 5.0, "q_proj,v_proj,down_proj", True)]:
            with self.subTest(rank=rank, targets=targets):
                self.check(rank, alpha, targets, tied)


def dequantized_moe(model):
    """A Mixtral or DeepSeek with every block matrix but the router (what bitsandbytes' Linear4bit
    quantizes on transformers 5: attention's, MLA's, the dense blocks' and shared experts'
    projections, each in its published row order) and each routed expert's w1, w3 and w2
    (forge's NOTE [NF4 expert stacks]: what Linear4bit stores for them on transformers 4)
    replaced by their NF4 round trips."""
    copy = type(model)(model.config).float().eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if name.endswith(".mlp.experts.gate_up_proj"):
                ffn = p.shape[1] // 2
                for e in range(p.shape[0]):
                    p[e, :ffn] = nf4_roundtrip(p[e, :ffn])
                    p[e, ffn:] = nf4_roundtrip(p[e, ffn:])
            elif name.endswith(".mlp.experts.down_proj"):
                for e in range(p.shape[0]):
                    p[e] = nf4_roundtrip(p[e])
            elif ".layers." in name and p.dim() == 2 and not name.endswith(".mlp.gate.weight"):
                p.copy_(nf4_roundtrip(p))
    return copy


class QloraMoeVsPeft(unittest.TestCase):
    """QLoRA on Mixture-of-Experts models: forge quantizes the block matrices and every routed
    expert's, leaves the router in its dtype, and (DeepSeek) quantizes MLA's query and kv_a
    projections in their published row order (NOTE [NF4 stored row order]); with a PEFT adapter
    over that dequantized model, forge's logits, loss (with the balancing loss) and adapter
    gradients equal PEFT's in float64, and its merged export equals merge_and_unload()."""

    def check(self, family, config, targets):
        from test_lora_moe_vs_peft import expect_forge_matches_peft, expect_merged_export_matches
        from hf_tiny import random_model
        work = scratch_dir()
        self.addCleanup(shutil.rmtree, work, ignore_errors=True)
        model = random_model(family, config, seed=5)
        model.save_pretrained(os.path.join(work, "base"))
        peft = get_peft_model(dequantized_moe(model), LoraConfig(r=3, lora_alpha=6.0, lora_dropout=0.0,
                                                                target_modules=targets.split(","),
                                                                task_type="CAUSAL_LM"))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.4)
        peft.save_pretrained(os.path.join(work, "peft_adapter"))
        b, s = 2, 7
        tokens = torch.randint(0, 53, (b, s), dtype=torch.int32)
        labels = torch.randint(0, 53, (b, s), dtype=torch.int32)
        tokens.numpy().tofile(os.path.join(work, "tokens.bin"))
        labels.numpy().tofile(os.path.join(work, "targets.bin"))
        with open(os.path.join(work, "lora.json"), "w") as f:
            json.dump(dict(rank=3, alpha=6.0, target_modules=targets, batch=b, seq_len=s, quantize_base="nf4"), f)
        run([tool("forge_lora_reference"), work])
        expect_forge_matches_peft(self, work, peft, tokens, labels, family, f"QLoRA {family}")
        expect_merged_export_matches(self, work, peft, family)

    def test_mixtral(self):
        from test_lora_moe_vs_peft import mixtral
        # Experts' matrices of 64 x 32: NF4 blocks of 64 inside each expert's own tensor.
        self.check("mixtral", mixtral(hidden_size=32, intermediate_size=64, head_dim=8),
                   "q_proj,k_proj,v_proj,o_proj,gate")

    def test_deepseek_v2_and_v3(self):
        from test_lora_moe_vs_peft import MLA_V2, MLA_V3, deepseek_v2, deepseek_v3
        self.check("deepseek_v2", deepseek_v2(), MLA_V2 + ",gate")
        self.check("deepseek_v3", deepseek_v3(), MLA_V3 + ",gate")

    def test_forge_train_on_a_mixtral(self):
        from test_lora_moe_vs_peft import mixtral
        from hf_tiny import random_model
        work = scratch_dir()
        self.addCleanup(shutil.rmtree, work, ignore_errors=True)
        base = os.path.join(work, "base")
        random_model("mixtral", mixtral(hidden_size=32, intermediate_size=64, head_dim=8), seed=6).save_pretrained(base)
        run_dir = os.path.join(work, "run")
        out = run([forge_bin(), "train", "--checkpoint.initial_load_path", base, "--checkpoint.initial_load_in_hf",
                   "true", "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "q_proj,v_proj,gate",
                   "--lora.quantize_base", "nf4", "--training.local_batch_size", "2", "--training.seq_len", "32",
                   "--training.steps", "6", "--logging.run_dir", run_dir, "--eval.interval", "0",
                   "--optimizer.lr", "3e-3", "--activation_checkpoint.mode", "selective"])
        self.assertIn("quantized to NF4 at import", out.stderr + out.stdout)
        losses = train_losses(run_dir)
        self.assertEqual(len(losses), 6)
        self.assertLess(losses[-1], losses[0])


class QloraTraining(unittest.TestCase):
    def setUp(self):
        self.work = scratch_dir()
        self.addCleanup(shutil.rmtree, self.work, ignore_errors=True)
        self.base = os.path.join(self.work, "base")
        base_model(seed=3, tied=False).save_pretrained(self.base)

    def command(self, run_dir, *extra):
        return [forge_bin(), "train", "--checkpoint.initial_load_path", self.base, "--checkpoint.initial_load_in_hf",
                "true", "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "all-linear",
                "--lora.quantize_base", "nf4", "--training.local_batch_size", "2", "--training.seq_len", "32",
                "--logging.run_dir", run_dir, "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "8",
                "--eval.interval", "0", *extra]

    def test_trains_exports_and_resumes_bitwise(self):
        run_dir = os.path.join(self.work, "run")
        out = run(self.command(run_dir, "--training.steps", "4", "--checkpoint.last_save_in_hf", "true",
                               "--activation_checkpoint.mode", "full"))
        self.assertIn("quantized to NF4 at import", out.stderr + out.stdout)
        adapter = load_file(os.path.join(run_dir, "adapter", "adapter_model.safetensors"))
        self.assertTrue(any(float(t.abs().max()) > 0 for n, t in adapter.items() if "lora_B" in n), "B did not train")
        dequantized = dequantized_copy(AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32))
        dequantized.save_pretrained(os.path.join(self.work, "dequantized"))
        tokens = torch.from_numpy(np.random.RandomState(2).randint(0, 53, size=(2, 13)))
        hf = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float64, attn_implementation="eager").eval()
        peft = PeftModel.from_pretrained(hf(os.path.join(self.work, "dequantized")),
                                         os.path.join(run_dir, "adapter")).eval()
        with torch.no_grad():
            a = peft(input_ids=tokens).logits.numpy()
            b = hf(os.path.join(run_dir, "hf"))(input_ids=tokens).logits.numpy()
        self.assertLess(relative_error(b, a), 1e-5, "merged QLoRA export against the adapter on the NF4 base")

        common = ["--lora.dropout", "0.1", "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
        straight = os.path.join(self.work, "straight")
        run(self.command(straight, "--training.steps", "6", *common))
        resumed = os.path.join(self.work, "resumed")
        run(self.command(resumed, "--training.steps", "3", *common))
        run(self.command(resumed, "--training.steps", "6", *common))
        self.assertEqual(train_losses(straight), train_losses(resumed))
        self.assertEqual(len(train_losses(straight)), 6)

        # The same adapters continued on the bf16 base: allowed, with a warning.
        cmd = self.command(resumed, "--training.steps", "7", *common)
        cmd[cmd.index("--lora.quantize_base") + 1] = "none"
        out = run(cmd)
        self.assertIn("trained with lora.quantize_base nf4, this run has none", out.stderr + out.stdout)

    def test_needs_adapters(self):
        cmd = self.command(os.path.join(self.work, "bad"), "--training.steps", "1")
        result = subprocess.run(cmd + ["--lora.rank", "0"], capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("needs LoRA adapters to train: set lora.rank > 0", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.work, "bad", "metrics.jsonl")))

    def test_without_a_hugging_face_import_quantizes_the_seeded_initialization(self):
        # A benchmark's QLoRA (as the PEFT peer's --qlora on a random model); resumed bitwise.
        def command(run_dir, steps):
            cmd = self.command(run_dir, "--training.steps", steps, "--checkpoint.enable", "true",
                               "--checkpoint.interval", "2")
            cmd[cmd.index("--checkpoint.initial_load_in_hf") + 1] = "false"
            cmd[cmd.index("--checkpoint.initial_load_path") + 1] = ""
            return cmd
        straight, resumed = os.path.join(self.work, "seeded"), os.path.join(self.work, "seeded-resumed")
        out = run(command(straight, "4"))
        self.assertIn("QLoRA", out.stdout + out.stderr)
        run(command(resumed, "2"))
        run(command(resumed, "4"))
        self.assertEqual(len(train_losses(straight)), 4)
        self.assertEqual(train_losses(straight), train_losses(resumed))


if __name__ == "__main__":
    unittest.main()
